"""Stable failure vocabulary: ``ErrorCode``, ``StorageConflictKind`` and ``RunlaneError``.

Every failure a caller can act on is a ``RunlaneError`` with a stable ``code``, an explicit
``retryable`` flag and JSON-safe ``meta``. Callers branch on ``code`` (and, for storage conflicts,
on ``meta["storage_conflict_kind"]``), never on message text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ErrorCode",
    "RunlaneError",
    "StorageConflictKind",
    "create_storage_conflict_error",
    "describe_exception",
    "get_storage_conflict_kind",
    "is_storage_conflict",
]


class ErrorCode(enum.StrEnum):
    ADAPTER_CONTRACT_VIOLATION = "adapter_contract_violation"
    CAPABILITY_UNSUPPORTED = "capability_unsupported"
    CONFIGURATION_INVALID = "configuration_invalid"
    INTERNAL_ERROR = "internal_error"
    INVARIANT_VIOLATION = "invariant_violation"
    OPERATION_CANCELLED = "operation_cancelled"
    OBSERVATION_EXPORT_FAILED = "observation_export_failed"
    RUN_NOT_FOUND = "run_not_found"
    SCHEDULE_NOT_FOUND = "schedule_not_found"
    STORAGE_CONFLICT = "storage_conflict"
    STORAGE_UNAVAILABLE = "storage_unavailable"
    TASK_FAILED = "task_failed"
    TASK_NOT_FOUND = "task_not_found"
    TASK_OUTPUT_INVALID = "task_output_invalid"
    TASK_TIMED_OUT = "task_timed_out"
    TRANSPORT_PUBLISH_FAILED = "transport_publish_failed"
    TRANSPORT_UNAVAILABLE = "transport_unavailable"
    VALIDATION_FAILED = "validation_failed"


class StorageConflictKind(enum.StrEnum):
    EVENT_SEQUENCE = "event_sequence"
    IDEMPOTENCY_KEY = "idempotency_key"
    LEASE_OWNERSHIP = "lease_ownership"
    OBSERVATION_CHECKPOINT = "observation_checkpoint"
    OUTBOX_CLAIM = "outbox_claim"
    SCHEDULE_OCCURRENCE = "schedule_occurrence"
    SINGLETON_KEY = "singleton_key"
    # Python-side extension: a bounded-queue capacity partition has no free slot for a lease created
    # together with its run (``run_now``); nothing was written, so the call can be retried later.
    QUEUE_CAPACITY = "queue_capacity"
    # A storage transaction kept losing optimistic validation until its attempt budget ran out.
    TRANSACTION = "transaction"


STORAGE_CONFLICT_KIND_META_KEY = "storage_conflict_kind"


class RunlaneError(Exception):
    """A failure with a stable ``code``; ``retryable`` defaults to ``False``."""

    code: ErrorCode
    retryable: bool
    meta: dict[str, Any]

    def __init__(
        self,
        code: ErrorCode | str,
        message: str | None = None,
        *,
        retryable: bool = False,
        meta: Mapping[str, Any] | None = None,
        cause: BaseException | None = None,
    ) -> None:
        self.code = ErrorCode(code)
        self.message = message or _default_message(self.code)
        self.retryable = retryable
        self.meta = dict(meta or {})
        super().__init__(self.message)
        if cause is not None:
            self.__cause__ = cause

    def __repr__(self) -> str:
        return f"RunlaneError(code={self.code.value!r}, message={self.message!r}, retryable={self.retryable})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a ``multiprocessing`` or ``ProcessPoolExecutor`` child sends its exception to the parent,
        ``copy.copy()``) as its attributes, not by calling ``__init__`` again: an exception is rebuilt from
        its ``args``, which hold the message alone, and that is no error code (nor a subclass's arguments)."""
        return (_rebuild_error, (type(self), self.args), self.__dict__)

    def to_json(self) -> dict[str, Any]:
        """The JSON-safe public shape (no ``cause``: that is server-side detail only)."""
        return {"code": self.code.value, "message": self.message, "retryable": self.retryable, "meta": dict(self.meta)}


def _rebuild_error(cls: type[RunlaneError], args: tuple[Any, ...]) -> RunlaneError:
    """An unpickled ``RunlaneError`` (of class ``cls``), before pickle restores its attributes."""
    return cls.__new__(cls, *args)


def _default_message(code: ErrorCode) -> str:
    return code.value.replace("_", " ").capitalize() + "."


def create_storage_conflict_error(
    kind: StorageConflictKind | str,
    message: str | None = None,
    *,
    retryable: bool = True,
    meta: Mapping[str, Any] | None = None,
    cause: BaseException | None = None,
) -> RunlaneError:
    """A ``storage_conflict`` error carrying ``meta["storage_conflict_kind"]`` (retryable by default)."""
    conflict_kind = StorageConflictKind(kind)
    merged = dict(meta or {})
    merged[STORAGE_CONFLICT_KIND_META_KEY] = conflict_kind.value
    return RunlaneError(
        ErrorCode.STORAGE_CONFLICT,
        message or f"Storage conflict ({conflict_kind.value}): another writer changed the state first; retry the operation.",
        retryable=retryable,
        meta=merged,
        cause=cause,
    )


def get_storage_conflict_kind(error: BaseException) -> StorageConflictKind | None:
    """The conflict kind of a storage-conflict ``RunlaneError``, else ``None``."""
    if not isinstance(error, RunlaneError) or error.code is not ErrorCode.STORAGE_CONFLICT:
        return None
    raw = error.meta.get(STORAGE_CONFLICT_KIND_META_KEY)
    if not isinstance(raw, str):  # no kind (or not one a kind could be)
        return None
    try:
        return StorageConflictKind(raw)
    except ValueError:
        return None


def is_storage_conflict(error: BaseException, kind: StorageConflictKind | None = None) -> bool:
    found = get_storage_conflict_kind(error)
    return found is not None and (kind is None or found is kind)


def describe_exception(error: BaseException) -> str:
    """``Type: message`` of an exception from code runlane calls, on one line (a multi-line message,
    such as a pydantic ``ValidationError``'s, has its whitespace collapsed), or the type alone when it
    has no message (``SystemExit()``, a bare ``raise KeyError``)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def pydantic_message(detail: Any) -> str:
    """The message of one pydantic error (an item of ``ValidationError.errors()``) as a clause of ours:
    without the ``Value error, `` prefix pydantic adds to a validator's own text, and without its final
    full stop (the sentence it goes into ends with one)."""
    return str(detail["msg"]).removeprefix("Value error, ").rstrip(".")


def pydantic_problems(error: Any, whole: str) -> str:
    """Every problem of a pydantic ``ValidationError`` as ``field: message``, joined by ``; ``
    (``whole`` names a problem of the value as a whole)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or whole}: {pydantic_message(item)}"
        for item in error.errors(include_url=False)
    )
