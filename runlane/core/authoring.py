"""Defining work: ``queue()``, ``task()``, ``schedule()``, ``Retry``/``Backoff`` and the ``TaskRelease`` value.

This module owns deployment-time definitions and their validation: ids, durations, payload schemas
(pydantic), key resolvers, retry delays and the release value a handler returns. Definitions are
immutable and building one never touches storage, a lane or a runtime.

Malformed definitions and options raise ``RunlaneError(configuration_invalid)`` with a message that says
what to change; a payload that does not match its task's schema raises ``RunlaneError(validation_failed)``
with the pydantic errors in ``meta["errors"]``.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from typing import Any, ClassVar, Literal, TypeAlias, cast
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, PydanticUserError, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, core_schema

from ..defaults import contract_defaults
from ..durations import Duration, duration_ms, later, MAX_SAFE_INTEGER
from ..errors import ErrorCode, RunlaneError
from ..ids import validate_id
from ..json_values import (
    canonical_json,
    canonical_json_of_checked,
    ensure_json_object,
    ensure_json_value,
    is_json_value,
    is_unicode_text,
    non_finite_float_path,
)
from ..models import Actor, RunCompletionWaitCondition, SignalWaitCondition
from ..vocabulary import RetryBackoffType, RunWaitConditionType, ScheduleType, TaskReleaseType

__all__ = [
    "Backoff",
    "IdempotencyKeyTtl",
    "KeyResolver",
    "QueueDefinition",
    "Retry",
    "RetryPolicy",
    "ScheduleDefinition",
    "TaskDefinition",
    "TaskKeyKind",
    "TaskRelease",
    "build_run_wait",
    "build_signal_wait",
    "build_time_release",
    "parse_idempotency_key_ttl",
    "queue",
    "schedule",
    "task",
]

KeyResolver: TypeAlias = str | Callable[[Any], str]
"""A static key, or a function of the validated payload returning the key."""

TaskKeyKind: TypeAlias = Literal["idempotency_key", "singleton_key", "concurrency_key"]
IdempotencyKeyTtl: TypeAlias = int | Literal["active"]
"""Whole milliseconds, or ``"active"`` to release the key as soon as the run is terminal."""

_KEY_LABELS: dict[str, str] = {
    "idempotency_key": "idempotency key",
    "singleton_key": "singleton key",
    "concurrency_key": "concurrency key",
}
# Enough to act on; the full count stays in meta so a huge invalid list cannot bloat a stored failure.
MAX_REPORTED_ERRORS = 20
_MAX_SUMMARISED_ERRORS = 3
_SEND_MATCHING = "Send a payload that matches the task's schema."


class _Omitted:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<omitted>"


_OMITTED: Any = _Omitted()


# ---------------------------------------------------------------------------------------------
# Shared checks


def _invalid(message: str, *, cause: BaseException | None = None, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta, cause=cause)


def checked_reason(reason: object, what: str = "reason", *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> None:
    """Refuse a ``reason`` (of a release, a cancellation) that is not ``None`` or non-empty text storage can
    encode: a lone surrogate (undecodable bytes of a file name, say) would fail only when it is written."""
    if reason is None:
        return
    if not isinstance(reason, str) or not reason:
        raise RunlaneError(
            code, f"Invalid {what}: expected a non-empty string, got {reason!r}.", meta={"field": "reason"}
        )
    if not is_unicode_text(reason):
        raise RunlaneError(
            code,
            f"Invalid {what}: it is not valid Unicode text (it has a lone surrogate, which is what bytes that are "
            "not UTF-8 become when decoded with surrogateescape); decode such bytes with errors='replace'.",
            meta={"field": "reason"},
        )


def checked_actor(actor: object, default: Actor, *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> Actor:
    """``actor``, or ``default`` for ``None``; anything but an ``Actor`` whose id storage can encode is ``code``."""
    if actor is None:
        return default
    if not isinstance(actor, Actor):
        raise RunlaneError(
            code, f"actor must be an Actor(type=ActorType..., id=...), got {actor!r}.", meta={"field": "actor"}
        )
    if isinstance(actor.id, str) and not is_unicode_text(actor.id):
        raise RunlaneError(
            code,
            "The actor's id is not valid Unicode text (it has a lone surrogate, which is what bytes that are not "
            "UTF-8 become when decoded with surrogateescape); decode such bytes with errors='replace'.",
            meta={"field": "actor"},
        )
    return actor


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _invalid(f"Invalid {what}: expected a positive whole number, got {value!r}.", field=what)
    if value > MAX_SAFE_INTEGER:
        exact = f"{MAX_SAFE_INTEGER:,}, the largest whole number JSON keeps exact"
        raise _invalid(f"Invalid {what}: {value:,} is past {exact}.", field=what)
    return value


def _flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(f"Invalid {what}: expected True or False, got {value!r}.", field=what)
    return value


def _aware_utc(value: object, what: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise _invalid(
            f"Invalid {what}: expected a timezone-aware datetime such as datetime(2026, 1, 1, tzinfo=UTC), "
            f"got {value!r}.",
            field=what,
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:  # datetime(1, 1, 1, tzinfo=+05:00) is before the year 1 in UTC
        raise _invalid(f"Invalid {what}: {value!r} is out of range in UTC (years 1 to 9999).", field=what) from None


def _optional_queue(value: object, owner: str) -> QueueDefinition | None:
    if value is not None and not isinstance(value, QueueDefinition):
        raise _invalid(
            f"{owner}: queue must be the QueueDefinition returned by queue(...), got {value!r}.", field="queue"
        )
    return value


def _json_copy(value: Any) -> Any:
    """A detached copy of a JSON value already checked by ``ensure_json_value``."""
    return json.loads(canonical_json(value))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---------------------------------------------------------------------------------------------
# Queues


@dataclass(frozen=True, slots=True)
class QueueDefinition:
    """Where runs are routed and how many may execute at once. Build it with ``queue()``.

    Two definitions with the same name and policy compare equal, which is how the runtime detects
    drift between a task's queue and the registered one.
    """

    name: str
    default: bool = False
    concurrency_limit: int | None = None
    dispatch_timeout_ms: int | None = None

    @property
    def is_bounded(self) -> bool:
        return self.concurrency_limit is not None


def queue(
    name: str,
    *,
    default: bool = False,
    concurrency_limit: int | None = None,
    dispatch_timeout: Duration | None = None,
) -> QueueDefinition:
    """Define a queue; ``dispatch_timeout`` is only valid on a bounded queue (one with ``concurrency_limit``)."""
    queue_name = validate_id(name, "queue name")
    is_default = _flag(default, f"default of queue {queue_name!r}")
    limit = None
    if concurrency_limit is not None:
        limit = _positive_int(concurrency_limit, f"concurrency_limit of queue {queue_name!r}")
    timeout_ms = None
    if dispatch_timeout is not None:
        if limit is None:
            raise _invalid(
                f"Queue {queue_name!r}: dispatch_timeout only applies to bounded queues; "
                "set concurrency_limit or remove dispatch_timeout.",
                field="dispatch_timeout",
            )
        timeout_ms = duration_ms(dispatch_timeout, f"dispatch_timeout of queue {queue_name!r}")
    return QueueDefinition(name=queue_name, default=is_default, concurrency_limit=limit, dispatch_timeout_ms=timeout_ms)


# ---------------------------------------------------------------------------------------------
# Retry policy


@dataclass(frozen=True, slots=True, init=False)
class Backoff:
    """Delay between retries: ``Backoff(type=RetryBackoffType.EXPONENTIAL, delay="5s", max_delay="1m")``.

    Fixed backoff waits ``delay`` every time. Exponential backoff waits ``delay`` before the first retry
    and doubles from there, capped at ``max_delay`` (which applies only to exponential backoff).
    """

    type: RetryBackoffType
    delay_ms: int
    max_delay_ms: int | None

    def __init__(self, type: RetryBackoffType | str, delay: Duration, max_delay: Duration | None = None) -> None:
        try:
            kind = RetryBackoffType(type)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in RetryBackoffType)
            raise _invalid(
                f"Invalid backoff type {type!r}: use RetryBackoffType ({allowed}).", field="backoff.type"
            ) from None
        delay_value = duration_ms(delay, "backoff delay")
        max_delay_value = None
        if max_delay is not None:
            if kind is not RetryBackoffType.EXPONENTIAL:
                raise _invalid(
                    "max_delay applies only to exponential backoff; remove it from the fixed backoff.",
                    field="backoff.max_delay",
                )
            max_delay_value = duration_ms(max_delay, "backoff max_delay")
            if max_delay_value < delay_value:
                raise _invalid(
                    "Invalid backoff: max_delay must be greater than or equal to delay.", field="backoff.max_delay"
                )
        object.__setattr__(self, "type", kind)
        object.__setattr__(self, "delay_ms", delay_value)
        object.__setattr__(self, "max_delay_ms", max_delay_value)


ExceptionTypes = type[BaseException] | tuple[type[BaseException], ...]


@dataclass(frozen=True, slots=True, init=False)
class RetryPolicy:
    """``Retry(max_attempts, backoff=...)``: the total attempt budget (first attempt included) and its backoff.

    ``backoff`` is a ``Backoff``, a duration (fixed backoff), or omitted for ``contract_defaults.retry.backoff``.
    ``retry_on`` (an exception class or a tuple of them) limits retries to the exceptions it matches;
    ``no_retry_on`` fails the run at once on the exceptions it matches (it wins over ``retry_on``). Either
    only ever takes retries away: a ``RunlaneError`` that is not retryable is never retried. An exception
    group (what ``asyncio.TaskGroup`` raises) is retried when every exception in it matches ``retry_on``
    and none matches ``no_retry_on``.
    """

    max_attempts: int
    backoff: Backoff
    retry_on: tuple[type[BaseException], ...] | None
    no_retry_on: tuple[type[BaseException], ...]

    def __init__(
        self,
        max_attempts: int,
        backoff: Backoff | Duration | None = None,
        *,
        retry_on: ExceptionTypes | None = None,
        no_retry_on: ExceptionTypes | None = None,
    ) -> None:
        attempts = _positive_int(max_attempts, "retry max_attempts")
        if backoff is None:
            backoff = Backoff(RetryBackoffType.FIXED, contract_defaults.retry.backoff)
        elif not isinstance(backoff, Backoff):
            backoff = Backoff(RetryBackoffType.FIXED, backoff)
        object.__setattr__(self, "max_attempts", attempts)
        object.__setattr__(self, "backoff", backoff)
        retried = None if retry_on is None else _exception_types(retry_on, "retry_on")
        not_retried = () if no_retry_on is None else _exception_types(no_retry_on, "no_retry_on")
        object.__setattr__(self, "retry_on", retried)
        object.__setattr__(self, "no_retry_on", not_retried)

    def retries(self, error: BaseException) -> bool:
        """Whether an attempt that raised ``error`` may be retried as far as ``retry_on`` / ``no_retry_on``
        go (the failure's own retryability and the attempt budget decide too)."""
        if isinstance(error, BaseExceptionGroup):  # asyncio.TaskGroup's: decided by what it holds
            if self.no_retry_on and error.subgroup(self.no_retry_on) is not None:
                return False
            return self.retry_on is None or error.split(self.retry_on)[1] is None
        if self.no_retry_on and isinstance(error, self.no_retry_on):
            return False
        return self.retry_on is None or isinstance(error, self.retry_on)

    def delay_ms_for(self, failed_attempt: int) -> int:
        """Milliseconds to wait before retrying after attempt number ``failed_attempt`` (1-based) failed."""
        attempt = _positive_int(failed_attempt, "failed attempt number")
        backoff = self.backoff
        if backoff.type is RetryBackoffType.FIXED:
            return backoff.delay_ms
        cap = backoff.max_delay_ms if backoff.max_delay_ms is not None else MAX_SAFE_INTEGER
        # Past 2**53 the product exceeds every cap, so bound the exponent instead of building huge ints.
        return min(backoff.delay_ms * 2 ** min(attempt - 1, 53), cap)


Retry = RetryPolicy


def _exception_types(value: object, name: str) -> tuple[type[BaseException], ...]:
    types = value if isinstance(value, tuple) else (value,)
    if not types or not all(isinstance(item, type) and issubclass(item, BaseException) for item in types):
        raise _invalid(
            f"Retry {name} takes an exception class or a tuple of them, such as (ConnectionError, TimeoutError); "
            f"got {value!r}.",
            field=f"retry.{name}",
        )
    return types


# ---------------------------------------------------------------------------------------------
# Schedules


@dataclass(frozen=True, slots=True)
class ScheduleDefinition:
    """One task-colocated schedule. Build it with ``schedule()``; the kind is inferred from its selector.

    ``payload`` is the static JSON payload (``None`` with ``has_payload`` False when it was omitted).
    """

    id: str
    type: ScheduleType
    cron: str | None = None
    time_zone: str | None = None
    every_ms: int | None = None
    starts_at: datetime | None = None
    ends_at: datetime | None = None
    run_at: datetime | None = None
    payload: Any = None
    has_payload: bool = False
    queue: QueueDefinition | None = None
    enabled: bool = True


def schedule(
    id: str,
    *,
    cron: str | None = None,
    every: Duration | None = None,
    run_at: datetime | None = None,
    time_zone: str | None = None,
    starts_at: datetime | None = None,
    ends_at: datetime | None = None,
    payload: Any = _OMITTED,
    queue: QueueDefinition | None = None,
    enabled: bool = True,
) -> ScheduleDefinition:
    """Define a schedule with exactly one of ``cron``, ``every`` or ``run_at``.

    ``time_zone`` applies to cron schedules, ``starts_at`` / ``ends_at`` to interval schedules. The
    payload is checked against the task's schema when the schedule is attached with ``task(schedule=...)``.
    """
    schedule_id = validate_id(id, "schedule id")
    owner = f"Schedule {schedule_id!r}"
    selectors = [name for name, value in (("cron", cron), ("every", every), ("run_at", run_at)) if value is not None]
    if len(selectors) != 1:
        found = " and ".join(selectors) if selectors else "none"
        raise _invalid(f"{owner} needs exactly one of cron, every or run_at (got {found}).", field="schedule")
    if time_zone is not None and cron is None:
        raise _invalid(f"{owner}: time_zone applies only to cron schedules; remove it.", field="time_zone")
    if (starts_at is not None or ends_at is not None) and every is None:
        raise _invalid(
            f"{owner}: starts_at and ends_at apply only to interval (every=) schedules; remove them.", field="starts_at"
        )

    fields: dict[str, Any] = {}
    if cron is not None:
        if not isinstance(cron, str) or not cron.strip():
            raise _invalid(f"{owner}: cron must be a non-empty cron expression such as '0 9 * * *'.", field="cron")
        from .schedules import validate_cron  # the cron grammar lives with the timing rules

        fields.update(
            type=ScheduleType.CRON,
            cron=validate_cron(cron.strip(), schedule_id=schedule_id),
            time_zone=_time_zone(time_zone, owner),
        )
    elif every is not None:
        start = None if starts_at is None else _aware_utc(starts_at, f"starts_at of schedule {schedule_id!r}")
        end = None if ends_at is None else _aware_utc(ends_at, f"ends_at of schedule {schedule_id!r}")
        from .schedules import UNIX_EPOCH, interval_anchor_name

        if end is not None and end < (start or UNIX_EPOCH):
            raise _invalid(f"{owner}: ends_at must not be earlier than {interval_anchor_name(start)}.", field="ends_at")
        fields.update(
            type=ScheduleType.INTERVAL,
            every_ms=duration_ms(every, f"every of schedule {schedule_id!r}"),
            starts_at=start,
            ends_at=end,
        )
    else:
        fields.update(type=ScheduleType.ONCE, run_at=_aware_utc(run_at, f"run_at of schedule {schedule_id!r}"))

    has_payload = payload is not _OMITTED
    if has_payload:
        ensure_json_value(payload, f"payload of schedule {schedule_id!r}", code=ErrorCode.CONFIGURATION_INVALID)
        payload = _json_copy(payload)
    return ScheduleDefinition(
        id=schedule_id,
        payload=payload if has_payload else None,
        has_payload=has_payload,
        queue=_optional_queue(queue, owner),
        enabled=_flag(enabled, f"enabled of schedule {schedule_id!r}"),
        **fields,
    )


# Files of the host's time zone database that are not zone names: "localtime" is whatever this host is
# set to (and "posixrules" much the same), so processes on other hosts would compute other fire times.
_HOST_ZONES = frozenset({"localtime", "posixrules"})


@functools.lru_cache(maxsize=256)
def load_time_zone(name: str, owner: str | None = None) -> tzinfo:
    """The zone of an IANA time zone name; ``configuration_invalid`` (naming ``owner``) for anything else."""
    said = f"{owner}: time zone {name!r}" if owner else f"Time zone {name!r}"
    if name in _HOST_ZONES or name.startswith(("posix/", "right/")):
        raise _invalid(
            f"{said} is not an IANA zone name; name the zone itself, such as 'America/New_York'.", field="time_zone"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise _invalid(
            f"{said} is unknown; use an IANA name such as 'America/New_York' "
            "(install the tzdata package where the system has no time zone database).",
            field="time_zone",
        ) from None


def _time_zone(value: object, owner: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _invalid(
            f"{owner}: time_zone must be an IANA time zone name such as 'America/New_York'.", field="time_zone"
        )
    load_time_zone(value, owner)
    return value


# ---------------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True, eq=False)
class TaskDefinition:
    """A task: its id, handler, payload schema and execution policy. Build it with ``@task(...)``.

    Definitions compare by identity: the runtime registers and looks up this exact object.
    ``schema`` is the payload type (``None`` when the handler takes no payload); the pydantic
    ``TypeAdapter`` for it is built once, here.
    """

    id: str
    handler: Callable[..., Any]
    schema: Any
    queue: QueueDefinition | None
    retry: RetryPolicy | None
    max_attempt_duration_ms: int | None
    schedules: tuple[ScheduleDefinition, ...]
    idempotency_key: KeyResolver | None
    idempotency_key_ttl: IdempotencyKeyTtl | None
    singleton_key: KeyResolver | None
    concurrency_key: KeyResolver | None
    is_async: bool
    takes_payload: bool
    takes_context: bool
    _adapter: TypeAdapter[Any] | None = field(init=False, repr=False)
    _plain: bool = field(init=False, repr=False)  # the schema holds JSON values only (see ``gives_back``)

    def __post_init__(self) -> None:
        adapter = _payload_adapter(self.id, self.schema) if self.takes_payload else None
        object.__setattr__(self, "_adapter", adapter)
        object.__setattr__(self, "_plain", adapter is not None and _plain_json_schema(adapter.core_schema))

    def __repr__(self) -> str:
        handler = getattr(self.handler, "__qualname__", repr(self.handler))
        return f"TaskDefinition(id={self.id!r}, handler={handler})"

    def validate_payload(self, value: Any) -> Any:
        """Validate a payload given by a caller (Python values); returns what the handler receives.

        Plain JSON data the Python rules refuse is validated as JSON, the way every attempt reads the
        stored payload: a strict model takes ``"2024-03-01T10:00:00Z"`` for a ``datetime`` from a
        webhook body or the CLI as it does from storage."""
        subject = f"payload for task {self.id!r}"
        try:
            return self._validate(value, json_input=False, subject=subject)
        except RunlaneError:
            if self._adapter is None or not is_json_value(value):
                raise
        return self._validate(value, json_input=True, subject=subject)

    def load_payload(self, stored: Any) -> Any:
        """Validate a stored JSON payload in JSON mode, the exact inverse of ``dump_payload``."""
        return self._validate(
            stored,
            json_input=True,
            subject=f"stored payload of task {self.id!r}",
            hint="The run's payload no longer matches the task's schema; trigger a new run with one that does.",
        )

    def dump_payload(self, validated: Any) -> Any:
        """The JSON value to persist for a validated payload (``None`` for a task without payload)."""
        if self._adapter is None:
            return None
        path = non_finite_float_path(validated)
        if path is not None:
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"Invalid payload for task {self.id!r}: the number at {path} is NaN or infinite, which JSON "
                "cannot hold. Send null, a string or a finite number instead.",
                meta={"task_id": self.id, "path": path},
            )
        try:
            # By alias: the stored form is what the schema reads back (``Field(alias="userId")``
            # validates ``userId``, not ``user_id``), as the caller sent it.
            dumped = self._adapter.dump_python(validated, mode="json", by_alias=True)
        except (PydanticSerializationError, ValueError, RecursionError) as error:
            # ValueError: pydantic's "Maximum serialization depth exceeded" for a value nested too deeply.
            if self._plain:
                # Stored as given: say where and why it is not JSON (a key with a lone surrogate, which the
                # encoder names only as a codec error), as for any other value that is not.
                ensure_json_value(validated, f"payload for task {self.id!r}")
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"The payload for task {self.id!r} cannot be stored as JSON: {_first_line(error)}.",
                meta={"task_id": self.id},
            ) from None
        stored = ensure_json_value(dumped, f"payload for task {self.id!r}")
        # Every attempt validates the stored JSON again: it must give back what was validated here, or the
        # handler would see another value than the one triggered, or none at all.
        if not gives_back(self._adapter, validated, stored, plain=self._plain):
            raise self._unstorable(validated, stored)
        return stored

    def _unstorable(self, validated: Any, stored: Any) -> RunlaneError:
        """The error for a payload whose stored JSON does not validate back to it."""
        errors: list[dict[str, Any]] = []
        try:
            again = self._adapter.validate_json(canonical_json(stored))  # type: ignore[union-attr]  # has a payload
            what = "gives another value"
            read = type(again)
            if read is not type(validated) and isinstance(validated, read):  # pydantic keeps a subclass instance
                what = (
                    f"gives the schema's {read.__name__}, not the {type(validated).__name__} that was triggered "
                    f"(trigger with {read.__name__}(...) or a dict of its fields)"
                )
        except ValidationError as error:
            errors, summary = validation_errors(error)
            what = f"fails ({summary})"
        except (ValueError, RecursionError) as error:
            what = f"fails ({_first_line(error)})"
        except Exception as error:  # a validator's own TypeError, KeyError...
            what = f"raises {type(error).__name__} ({_first_line(error)})"
        return RunlaneError(
            ErrorCode.VALIDATION_FAILED,
            f"The payload for task {self.id!r} does not survive storage: validating the JSON it is stored as {what}, "
            "so attempts would not see what was triggered. Common causes: Field(validation_alias=...) without a "
            "matching serialization alias, SecretStr, Field(exclude=True), a computed field on a model that "
            "forbids extra fields, a validator that is not idempotent, a union such as str | datetime (put "
            "datetime first), a model instance changed after it was validated, or a datetime or other value that is "
            "not JSON where the schema is an untyped dict or Any (type the field, or send its JSON form).",
            meta={"task_id": self.id, "errors": errors},
        )

    def resolve_key(self, kind: TaskKeyKind, payload: Any) -> str | None:
        """The task-level key of ``kind`` for a validated payload, or ``None`` when the task sets none."""
        if kind not in _KEY_LABELS:
            raise ValueError(f"Unknown key kind {kind!r}; expected one of {sorted(_KEY_LABELS)}.")
        resolver: KeyResolver | None = getattr(self, kind)
        label = _KEY_LABELS[kind]
        if resolver is None or isinstance(resolver, str):
            return resolver
        try:
            value = resolver(payload)
        except RunlaneError:
            raise
        except Exception as error:
            raise _invalid(
                f"The {label} resolver of task {self.id!r} raised {type(error).__name__}: {error}. "
                "Make it return a key for every valid payload.",
                cause=error,
                task_id=self.id,
                field=kind,
            ) from error
        if inspect.iscoroutine(value) or inspect.isgenerator(value) or inspect.isasyncgen(value):
            if inspect.iscoroutine(value):
                value.close()  # never run: no warning about a coroutine left unawaited
            raise _not_a_key_function(kind, self.id)
        return validate_id(value, f"{label} resolved for task {self.id!r}")

    def _validate(self, value: Any, *, json_input: bool, subject: str, hint: str = _SEND_MATCHING) -> Any:
        if self._adapter is None:
            if value is not None:
                advice = "Omit it." if hint is _SEND_MATCHING else hint  # a stored payload cannot be omitted
                raise RunlaneError(
                    ErrorCode.VALIDATION_FAILED,
                    f"Invalid {subject}: the task takes no payload (got {type(value).__name__}). {advice}",
                    meta={"task_id": self.id, "errors": []},
                )
            return None
        text = canonical_json_of_checked(ensure_json_value(value, subject)) if json_input else None
        try:
            return self._adapter.validate_python(value) if text is None else self._adapter.validate_json(text)
        except ValidationError as error:
            raise _payload_validation_error(self.id, subject, error, hint) from None
        except Exception as error:
            # pydantic turns only a validator's ValueError and AssertionError into validation errors.
            kind = type(error).__name__
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"Invalid {subject}: the schema raised {kind} validating it ({_first_line(error)}); a validator "
                f"should raise ValueError for a value it refuses. {hint}",
                meta={"task_id": self.id, "error_type": kind, "errors": []},
                cause=error,
            ) from error


# Core schema types whose JSON-mode validation gives back the JSON value it is given, and the fields
# that hold their element schemas.
_PLAIN_LEAVES = frozenset({"any", "none", "bool", "int", "float", "str"})
_PLAIN_CHILDREN = {"list": ("items_schema",), "dict": ("keys_schema", "values_schema"), "nullable": ("schema",)}
# JSON object keys are strings: validating them as another type (``dict[int, str]``) does not give them back.
_PLAIN_KEYS = frozenset({"any", "str"})


def _plain_json_schema(schema: Any) -> bool:
    """Whether a pydantic core schema is built only of JSON types with no options (``dict``, ``list[int]``,
    ``dict[str, Any]``, ``str | None``...): no aliases, validators, constraints or custom types."""
    kind = schema.get("type")
    if kind in _PLAIN_LEAVES:
        return bool(schema.keys() <= {"type", "metadata"})
    children = _PLAIN_CHILDREN.get(kind)
    if children is None or not schema.keys() <= {"type", "metadata", *children}:
        return False
    if kind == "dict" and "keys_schema" in schema and schema["keys_schema"].get("type") not in _PLAIN_KEYS:
        return False
    return all(child not in schema or _plain_json_schema(schema[child]) for child in children)


def gives_back(adapter: TypeAdapter[Any], validated: Any, stored: Any, *, plain: bool = False) -> bool:
    """Whether validating ``stored``, the JSON dump of ``validated``, gives ``validated`` back (and the same
    dump): false for a schema whose transform changes its own output (``AfterValidator(lambda v: v * 2)``),
    that stores less than it holds (a ``SecretStr``, a ``Field(exclude=True)``) or reads another name than
    it writes (``Field(validation_alias=...)``), and for a value that is not JSON under ``Any``.

    ``plain``: the schema is ``_plain_json_schema``, whose validation of a JSON value gives that value
    back, so the dump need only equal what was validated."""
    if plain:  # a tuple under Any is stored as a JSON array, as json.dumps writes one: a list is no surprise
        return _equal_but_for_tuples(stored, validated)
    return read_back(adapter, validated, stored) is not NOT_GIVEN_BACK


NOT_GIVEN_BACK: Any = object()


def read_back(adapter: TypeAdapter[Any], validated: Any, stored: Any) -> Any:
    """What validating ``stored``, the JSON dump of ``validated``, gives when that is ``validated`` again (see
    ``gives_back``): ``validated`` itself, or the value read when it holds lists where ``validated`` holds
    tuples (under an untyped field, stored as JSON arrays); ``NOT_GIVEN_BACK`` when it is another value."""
    try:
        again = adapter.validate_json(canonical_json(stored))
        if adapter.dump_python(again, mode="json", by_alias=True) != stored:
            return NOT_GIVEN_BACK
    except Exception:  # a validation error, or a validator's own exception on the stored form
        return NOT_GIVEN_BACK
    if type(validated).__eq__ is object.__eq__:  # a value that cannot be compared: its JSON matched
        return validated
    try:
        if again == validated:
            return validated
    except Exception:  # a comparison that fails says nothing either
        return validated
    try:
        return again if _equal_but_for_tuples(again, validated) else NOT_GIVEN_BACK
    except Exception:
        return NOT_GIVEN_BACK


def _equal_but_for_tuples(read: Any, given: Any) -> bool:
    """``read == given``, except that a list and a tuple of equal items are equal: a tuple under an untyped
    field of a model (``Any``, ``dict``) is stored as a JSON array and read back as a list, as a tuple in an
    untyped payload is."""
    if isinstance(read, (list, tuple)) and isinstance(given, (list, tuple)):
        return len(read) == len(given) and all(map(_equal_but_for_tuples, read, given))
    if isinstance(read, dict) and isinstance(given, dict):
        return read.keys() == given.keys() and all(_equal_but_for_tuples(read[key], given[key]) for key in read)
    if isinstance(read, BaseModel) and type(read) is type(given):
        return (
            _equal_but_for_tuples(read.__dict__, given.__dict__)
            and _equal_but_for_tuples(read.__pydantic_extra__ or {}, given.__pydantic_extra__ or {})
            and read.__pydantic_private__ == given.__pydantic_private__
        )
    return bool(read == given)


def validation_errors(error: ValidationError, whole: str = "payload") -> tuple[list[dict[str, Any]], str]:
    """The errors of ``error`` for ``meta`` (where each is, its type and pydantic's message), and a one-line
    summary of the first few for the message (``whole`` names an error of the whole value).

    ``meta`` can be persisted with a failed run, and payloads may carry personal data, so the errors keep
    neither the input nor the ``ctx`` values, and the message of a validator of the schema's own
    (``ValueError``, ``assert``, a custom error type), which often quotes the value, is replaced by its
    kind. The summary, which only the caller sees (persisted failure messages are normalized), keeps it.
    """
    errors = json.loads(error.json(include_url=False, include_input=False))
    return [_persistable(item) for item in errors], summarize_errors(errors, whole)


def summarize_errors(errors: Sequence[Mapping[str, Any]], whole: str = "payload") -> str:
    """One line naming the first few of ``errors`` (each where it is and its message), and how many more
    there are; ``whole`` names an error of the whole value."""
    summary = "; ".join(
        f"{error_location(item['loc'], whole)}: {item['msg']}" for item in errors[:_MAX_SUMMARISED_ERRORS]
    )
    if len(errors) > _MAX_SUMMARISED_ERRORS:
        summary += f"; and {len(errors) - _MAX_SUMMARISED_ERRORS} more"
    return summary


# pydantic's own error types, whose messages are written from the schema (limits, expected values).
_PYDANTIC_ERROR_TYPES = frozenset(typing.get_args(core_schema.ErrorType))
_OWN_VALIDATOR_MESSAGES = {"value_error": "Value error", "assertion_error": "Assertion failed"}


def _persistable(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type")
    message = item.get("msg")
    if kind in _OWN_VALIDATOR_MESSAGES:
        message = _OWN_VALIDATOR_MESSAGES[kind]
    elif kind not in _PYDANTIC_ERROR_TYPES:
        message = f"Invalid ({kind})"
    return {"type": kind, "loc": item.get("loc", []), "msg": message}


def _payload_validation_error(task_id: str, subject: str, error: ValidationError, hint: str) -> RunlaneError:
    errors, summary = validation_errors(error)
    return RunlaneError(
        ErrorCode.VALIDATION_FAILED,
        f"Invalid {subject}: {summary}. {hint}",
        meta={"task_id": task_id, "error_count": len(errors), "errors": errors[:MAX_REPORTED_ERRORS]},
    )


def error_location(loc: Sequence[str | int], whole: str = "payload") -> str:
    """Where a validation error is: ``whole`` (``payload``) for the whole, ``items[0].sku`` for a part."""
    if not loc:
        return whole
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _payload_adapter(task_id: str, schema: Any) -> TypeAdapter[Any]:
    try:
        adapter: TypeAdapter[Any] = TypeAdapter(schema)
        # A string or forward reference is only resolved on first use; resolve it now so a typo fails here.
        if not getattr(adapter, "pydantic_complete", True):
            adapter.rebuild(raise_errors=True)
    except Exception as error:  # pydantic fails on some values with a bare KeyError or AttributeError
        detail = _first_line(error)
        if not isinstance(error, PydanticUserError):
            detail = f"{type(error).__name__}: {detail}"
        raise _invalid(
            f"Task {task_id!r}: {schema!r} cannot be used as a payload schema ({detail}). "
            "Use a pydantic model class or a type pydantic.TypeAdapter accepts.",
            cause=error,
            task_id=task_id,
            field="schema",
        ) from error
    return adapter


def parse_idempotency_key_ttl(value: object, what: str = "idempotency_key_ttl") -> IdempotencyKeyTtl:
    """``"active"`` or a duration resolved to whole milliseconds."""
    if value == "active":
        return "active"
    try:
        return duration_ms(value, what)
    except RunlaneError as error:
        if not isinstance(value, str) or value[:1].isdigit():
            raise
        # A word that is not 'active' ('forever', 'Active'): name both forms the option takes.
        raise RunlaneError(
            error.code, f"Invalid {what} {value!r}: use 'active' or a duration such as '1h' or '7d'.", meta=error.meta
        ) from None


@dataclass(frozen=True, slots=True)
class _HandlerShape:
    takes_payload: bool
    takes_context: bool
    is_async: bool
    payload_parameter: inspect.Parameter | None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_HANDLER_FORMS = "a task handler takes (), (payload) or (payload, ctx)"


def _handler_shape(task_id: str, handler: object) -> _HandlerShape:
    owner = f"Task {task_id!r}"
    if not callable(handler):
        raise _invalid(f"{owner}: the handler must be a function, got {handler!r}.", field="handler")
    if inspect.isgeneratorfunction(handler) or inspect.isasyncgenfunction(handler):
        raise _invalid(
            f"{owner}: the handler is a generator; return the output instead of yielding it.", field="handler"
        )
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError) as error:
        raise _invalid(
            f"{owner}: cannot read the handler's signature ({error}); pass a plain function.", field="handler"
        ) from None
    positional: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.kind in _POSITIONAL:
            positional.append(parameter)
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL or (
            parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is inspect.Parameter.empty
        ):
            raise _invalid(
                f"{owner}: parameter {parameter.name!r} is not supported; {_HANDLER_FORMS}.", field="handler"
            )
    if len(positional) > 2:
        raise _invalid(f"{owner}: the handler has {len(positional)} parameters; {_HANDLER_FORMS}.", field="handler")
    # An instance of a class with ``async def __call__`` is an async handler too.
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)
    return _HandlerShape(
        takes_payload=len(positional) >= 1,
        takes_context=len(positional) == 2,
        is_async=is_async,
        payload_parameter=positional[0] if positional else None,
    )


def _annotation_schema(task_id: str, handler: Callable[..., Any], parameter: inspect.Parameter) -> Any:
    """The payload parameter's annotation; an unannotated parameter accepts any JSON value."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return Any
    if isinstance(annotation, str):
        # This annotation alone: ctx's or the return type may name what is imported only for type checkers.
        try:
            annotation = eval(annotation, _annotation_globals(handler))  # noqa: S307 - as inspect evaluates it
        except Exception as error:
            raise _invalid(
                f"Task {task_id!r}: cannot resolve the payload annotation {annotation!r} ({error}). "
                "Define the type at module level or pass schema= to task().",
                cause=error,
                task_id=task_id,
                field="schema",
            ) from error
    from .attempt import TaskContext  # the context is built on the definitions of this module

    if isinstance(annotation, type) and issubclass(annotation, TaskContext):
        raise _invalid(
            f"Task {task_id!r}: the first parameter is the payload, but {parameter.name!r} is annotated TaskContext. "
            "Take (payload, ctx) (payload: None for a task without payload), or take no parameters and call "
            "runlane.current_task_context().",
            task_id=task_id,
            field="handler",
        )
    return annotation


def _annotation_globals(handler: Callable[..., Any]) -> dict[str, Any]:
    """The namespace ``inspect.signature(handler, eval_str=True)`` evaluates the handler's annotations in:
    the module globals of the function behind a decorator's wrapper, a partial, a bound method or a
    callable object's ``__call__``."""
    target: Any = inspect.unwrap(handler)
    while isinstance(target, functools.partial) or inspect.ismethod(target):
        target = inspect.unwrap(target.func if isinstance(target, functools.partial) else target.__func__)
    call = getattr(type(target), "__call__", None)
    if not inspect.isfunction(target) and not isinstance(target, type) and inspect.isfunction(call):
        target = inspect.unwrap(call)
    namespace = getattr(target, "__globals__", None)
    return namespace if isinstance(namespace, dict) else {}


def _key_resolver(value: object, kind: str, task_id: str) -> KeyResolver | None:
    if value is None:
        return None
    if callable(value):
        if any(check(value) or check(type(value).__call__) for check in _NOT_KEY_FUNCTIONS):
            raise _not_a_key_function(kind, task_id)
        return value
    if isinstance(value, str):
        return validate_id(value, f"{_KEY_LABELS[kind]} of task {task_id!r}")
    raise _invalid(
        f"Task {task_id!r}: {kind} must be a string or a function of the payload returning a string, got {value!r}.",
        field=kind,
    )


# A call of these gives a coroutine or a generator, never a key.
_NOT_KEY_FUNCTIONS = (inspect.iscoroutinefunction, inspect.isasyncgenfunction, inspect.isgeneratorfunction)


def _not_a_key_function(kind: str, task_id: str) -> RunlaneError:
    return _invalid(
        f"Task {task_id!r}: the {_KEY_LABELS[kind]} resolver gives a coroutine or a generator (it is async or "
        "yields), not a key; pass a plain function of the payload that returns the key as a string.",
        field=kind,
        task_id=task_id,
    )


def _schedules(value: object, task_id: str) -> tuple[ScheduleDefinition, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, ScheduleDefinition) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise _invalid(
            f"Task {task_id!r}: schedule must be a schedule(...) or a list of them, got {value!r}.", field="schedule"
        )
    seen: set[str] = set()
    for item in items:
        if not isinstance(item, ScheduleDefinition):
            raise _invalid(
                f"Task {task_id!r}: every schedule must come from schedule(...), got {item!r}.", field="schedule"
            )
        if item.id in seen:
            raise _invalid(
                f"Task {task_id!r}: schedule id {item.id!r} is used twice; schedule ids must be unique.",
                field="schedule",
            )
        seen.add(item.id)
    return tuple(items)


_FIX_SCHEDULE = (
    "Change the schedule's payload= to one the task accepts, or pass enabled=False to schedule() until it does."
)


def schedule_payload(definition: TaskDefinition, item: ScheduleDefinition, *, when_registered: bool = True) -> Any:
    """The validated static payload of ``item``, a schedule of ``definition`` (checked when the task is
    registered, and again before each materialization: the task's schema may have changed since), or
    ``configuration_invalid`` naming the schedule and how to fix it."""
    subject = f"payload of schedule {item.id!r} (task {definition.id!r})"
    hint = _SEND_MATCHING if when_registered else _FIX_SCHEDULE
    try:
        payload = definition._validate(item.payload, json_input=True, subject=subject, hint=hint)
        definition.dump_payload(payload)
    except RunlaneError as error:
        # A payload that validates but does not survive storage is named by its task: say which schedule.
        named = error.message if subject in error.message else f"Schedule {item.id!r}: {error.message}"
        missing = "" if item.has_payload else " Pass payload= to schedule()."
        raise _invalid(
            f"{named}{missing}",
            task_id=definition.id,
            schedule_id=item.id,
            errors=error.meta.get("errors", []),
        ) from None
    return payload


def _check_schedule_payloads(definition: TaskDefinition) -> None:
    for item in definition.schedules:
        payload = schedule_payload(definition, item)
        # Every tick resolves these keys before it claims the schedule's fire time: a resolver that
        # fails on the static payload would fail every tick, and stop its other phases, until fixed.
        for kind in ("singleton_key", "concurrency_key"):
            try:
                definition.resolve_key(kind, payload)
            except RunlaneError as error:
                raise _invalid(
                    f"Schedule {item.id!r}: {error.message}", task_id=definition.id, schedule_id=item.id, field=kind
                ) from None


def task(
    id: str,
    *,
    queue: QueueDefinition | None = None,
    schema: Any = None,
    retry: RetryPolicy | None = None,
    max_attempt_duration: Duration | None = None,
    schedule: ScheduleDefinition | Sequence[ScheduleDefinition] | None = None,
    idempotency_key: KeyResolver | None = None,
    idempotency_key_ttl: Duration | Literal["active"] | None = None,
    singleton_key: KeyResolver | None = None,
    concurrency_key: KeyResolver | None = None,
) -> Callable[[Callable[..., Any]], TaskDefinition]:
    """Decorate a handler into a ``TaskDefinition``: ``@task("emails.welcome", queue=emails)``.

    The payload schema is ``schema`` when given, else the annotation of the handler's first parameter;
    a handler without parameters takes no payload. ``async def`` handlers run on the event loop, plain
    ``def`` handlers in a worker thread.
    """
    if callable(id) and not isinstance(id, str):
        raise _invalid(
            'task() needs a task id: write @task("emails.welcome") above the handler, not a bare @task.', field="id"
        )
    task_id = validate_id(id, "task id")
    owner = f"Task {task_id!r}"
    task_queue = _optional_queue(queue, owner)
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise _invalid(f"{owner}: retry must be Retry(max_attempts=..., backoff=...), got {retry!r}.", field="retry")
    attempt_ms = None
    if max_attempt_duration is not None:
        attempt_ms = duration_ms(max_attempt_duration, f"max_attempt_duration of task {task_id!r}")
    schedules = _schedules(schedule, task_id)
    idempotency = _key_resolver(idempotency_key, "idempotency_key", task_id)
    singleton = _key_resolver(singleton_key, "singleton_key", task_id)
    concurrency = _key_resolver(concurrency_key, "concurrency_key", task_id)
    ttl = None
    if idempotency_key_ttl is not None:
        if idempotency is None:
            raise _invalid(
                f"{owner}: idempotency_key_ttl needs an idempotency key; set idempotency_key or remove the ttl.",
                field="idempotency_key_ttl",
            )
        ttl = parse_idempotency_key_ttl(idempotency_key_ttl, f"idempotency_key_ttl of task {task_id!r}")

    def decorate(handler: Callable[..., Any]) -> TaskDefinition:
        shape = _handler_shape(task_id, handler)
        payload_schema = schema
        if not shape.takes_payload:
            if schema is not None:
                raise _invalid(
                    f"{owner}: schema is set but the handler has no payload parameter; "
                    "add a payload parameter or remove schema.",
                    field="schema",
                )
        elif schema is None and shape.payload_parameter is not None:
            payload_schema = _annotation_schema(task_id, handler, shape.payload_parameter)
        definition = TaskDefinition(
            id=task_id,
            handler=handler,
            schema=payload_schema,
            queue=task_queue,
            retry=retry,
            max_attempt_duration_ms=attempt_ms,
            schedules=schedules,
            idempotency_key=idempotency,
            idempotency_key_ttl=ttl,
            singleton_key=singleton,
            concurrency_key=concurrency,
            is_async=shape.is_async,
            takes_payload=shape.takes_payload,
            takes_context=shape.takes_context,
        )
        _check_schedule_payloads(definition)
        return definition

    return decorate


# ---------------------------------------------------------------------------------------------
# Releases


_RELEASE_TARGETS = ("delay_ms", "signal_key", "run_id", "timeout_ms")


@dataclass(frozen=True, slots=True)
class TaskRelease:
    """What a handler returns to release its run into business waiting (not a failure, not a retry).

    Built by ``ctx.release`` / ``ctx.wait_for_signal`` / ``ctx.wait_for_run``. ``wait_type`` says which
    fields are set: ``TIME`` -> ``delay_ms``; ``SIGNAL`` -> ``signal_key``; ``RUN_COMPLETION`` ->
    ``run_id``; the last two may carry a ``timeout_ms`` fallback.
    """

    type: ClassVar[TaskReleaseType] = TaskReleaseType.RELEASE

    wait_type: RunWaitConditionType
    delay_ms: int | None = None
    signal_key: str | None = None
    run_id: str | None = None
    timeout_ms: int | None = None
    reason: str | None = None
    meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        try:
            kind = RunWaitConditionType(self.wait_type)
        except ValueError:
            raise _invalid(
                f"Invalid release wait_type {self.wait_type!r}: use RunWaitConditionType.", field="wait_type"
            ) from None
        present = {name for name in _RELEASE_TARGETS if getattr(self, name) is not None}
        expected = {
            RunWaitConditionType.TIME: ({"delay_ms"}, set()),
            RunWaitConditionType.SIGNAL: ({"signal_key"}, {"timeout_ms"}),
            RunWaitConditionType.RUN_COMPLETION: ({"run_id"}, {"timeout_ms"}),
        }[kind]
        required, optional = expected
        if not required <= present or present - required - optional:
            allowed = ", ".join(sorted(required | optional))
            raise _invalid(f"A {kind.value} release sets {allowed} only.", field="release")
        if self.delay_ms is not None:
            _positive_int(self.delay_ms, "release delay_ms")
        if self.timeout_ms is not None:
            _positive_int(self.timeout_ms, "release timeout_ms")
        if self.signal_key is not None:
            validate_id(self.signal_key, "signal key")
        if self.run_id is not None:
            validate_id(self.run_id, "run id")
        checked_reason(self.reason, "release reason")
        object.__setattr__(self, "wait_type", kind)
        if self.meta is not None:
            ensure_json_object(self.meta, "release meta", code=ErrorCode.CONFIGURATION_INVALID)
            object.__setattr__(self, "meta", _json_copy(self.meta))

    def wait_condition(self, now: datetime) -> SignalWaitCondition | RunCompletionWaitCondition | None:
        """The durable wait condition for a release recorded at ``now`` (``None`` for a time release)."""
        timeout_at = None if self.timeout_ms is None else later(now, self.timeout_ms)
        # ``__post_init__`` requires the wait type's target field: signal_key for SIGNAL, run_id for
        # RUN_COMPLETION.
        if self.wait_type is RunWaitConditionType.SIGNAL:
            return SignalWaitCondition(signal_key=cast(str, self.signal_key), timeout_at=timeout_at)
        if self.wait_type is RunWaitConditionType.RUN_COMPLETION:
            return RunCompletionWaitCondition(run_id=cast(str, self.run_id), timeout_at=timeout_at)
        return None


def build_time_release(
    delay: Duration,
    *,
    reason: str | None = None,
    meta: dict[str, Any] | None = None,
) -> TaskRelease:
    """Release the run until ``delay`` has passed."""
    return TaskRelease(
        wait_type=RunWaitConditionType.TIME, delay_ms=duration_ms(delay, "release delay"), reason=reason, meta=meta
    )


def build_signal_wait(
    signal_key: str,
    *,
    timeout: Duration | None = None,
    reason: str | None = None,
    meta: dict[str, Any] | None = None,
) -> TaskRelease:
    """Release the run until ``signals.send(signal_key)``, or until ``timeout`` as a fallback."""
    return TaskRelease(
        wait_type=RunWaitConditionType.SIGNAL,
        signal_key=validate_id(signal_key, "signal key"),
        timeout_ms=None if timeout is None else duration_ms(timeout, "wait timeout"),
        reason=reason,
        meta=meta,
    )


def build_run_wait(
    run_id: str,
    *,
    timeout: Duration | None = None,
    reason: str | None = None,
    meta: dict[str, Any] | None = None,
) -> TaskRelease:
    """Release the run until run ``run_id`` is terminal, or until ``timeout`` as a fallback."""
    return TaskRelease(
        wait_type=RunWaitConditionType.RUN_COMPLETION,
        run_id=validate_id(run_id, "run id"),
        timeout_ms=None if timeout is None else duration_ms(timeout, "wait timeout"),
        reason=reason,
        meta=meta,
    )
