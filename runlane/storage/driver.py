"""The storage driver contract: ``StorageDriver`` (get / query / with_transaction) and its transaction.

A transaction callback is a pure, replayable attempt:

1. ``get`` / ``query_candidates`` read (present *and* absent keys join the read set);
2. the first ``now()`` seals the read set and returns one frozen time for the attempt;
3. ``create`` / ``replace`` / ``delete`` / optional ``append`` stage mutations (each also ends reads);
4. the driver validates every read and commits everything atomically, or rolls back and replays the
   callback after a supported conflict. Only the committed attempt's return value escapes.

No I/O, user code, random ids or meaningful logs inside the callback: prepare identities before it.

A driver with ``StorageClockAuthority.CLIENT`` may expose ``use_clock(clock)``: ``create_runlane(clock=...)``
calls it so every later attempt's ``now()`` samples the runtime's clock (the in-memory driver does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Protocol, TypeGuard, TypeVar, runtime_checkable

from ..models import Environment, Page, RunEventRecord, RunRecord, RunSummary
from .operator import PaginationParams, RunEventFilter, RunFilter
from .types import (
    NewStorageRecord,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageProfile,
    StorageQuery,
    StorageQueryResult,
    StorageRecord,
    StorageRecordKey,
)

__all__ = [
    "OperatorReadDriver",
    "StorageDriver",
    "StorageTransaction",
    "StorageWakeHints",
    "supports_operator_reads",
    "supports_wake_hints",
]

T = TypeVar("T")


class StorageTransaction(Protocol):
    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        """One position per requested key, in order, ``None`` for a missing record (duplicates allowed)."""

    async def query_candidates(
        self, query: StorageQuery, *, mode: StorageCandidateMode = StorageCandidateMode.ADVISORY
    ) -> StorageQueryResult:
        """Index candidates. ``EXCLUSIVE`` (only when the profile says so) skips records held by other
        attempts and holds the returned ones until this attempt ends."""

    async def now(self) -> datetime:
        """The attempt's frozen time; the first call seals the read set."""

    def create(self, record: NewStorageRecord) -> None:
        """Stage a conditional insert: the key must be absent at commit (and not read as present)."""

    def replace(self, current: StorageRecord, record: NewStorageRecord) -> None:
        """Stage a replacement of ``current`` exactly as read by this attempt; the key cannot change."""

    def delete(self, current: StorageRecord) -> None:
        """Stage deletion of ``current`` exactly as read by this attempt (its index rows go with it)."""

    def append(self, command: StorageAppendCommand) -> None:
        """Stage one ordered append batch (only when ``profile.ordered_append``)."""


@runtime_checkable
class StorageDriver(Protocol):
    name: str
    profile: StorageProfile

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]: ...

    async def query(self, query: StorageQuery) -> StorageQueryResult: ...

    async def with_transaction(self, callback: Callable[[StorageTransaction], Awaitable[T]]) -> T: ...


@runtime_checkable
class OperatorReadDriver(Protocol):
    """Optional read model kept in the same commit as the raw records."""

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None: ...

    async def list_runs(self, filter: RunFilter, pagination: PaginationParams) -> Page[RunSummary]: ...

    async def list_run_events(self, filter: RunEventFilter, pagination: PaginationParams) -> Page[RunEventRecord]: ...


@runtime_checkable
class StorageWakeHints(Protocol):
    """Optional cross-process wake-up hints (Postgres ``LISTEN``/``NOTIFY``, for example).

    Core calls ``publish_wake_hint`` after a commit that made a run of ``queue`` due now, and idle
    poll workers ``subscribe_wake_hints`` so another process's trigger wakes them before their
    ``empty_poll_delay`` ends. Hints carry no state and may be lost, merged or duplicated: workers
    still poll, and every claim is decided by storage. Neither method may block or raise.

    A hint is an opaque string to the driver, which delivers it unchanged: a queue name, or
    ``cancel:<run id>`` (``:`` never occurs in a queue name), which asks the process running that
    run's attempt to heartbeat now so it observes a cancellation requested elsewhere. A driver
    whose transport cannot carry a string may deliver any hint as ``"*"``: every subscriber then
    polls, and a cancellation is observed at the next heartbeat as without hints.

    A driver's transaction objects may also offer ``wake_hint(queue) -> bool``: core calls it from a
    write path (a trigger) before the commit, and ``True`` means the hint goes out with that commit
    (delivered when it commits, dropped when it does not), so core does not publish it again.
    """

    def publish_wake_hint(self, queue: str) -> None:
        """Schedule a hint for ``queue`` (debounced by the driver); returns at once."""

    def subscribe_wake_hints(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(queue)`` (from any thread) for hints from any process; returns an unsubscribe."""


def supports_wake_hints(driver: object) -> TypeGuard[StorageWakeHints]:
    return all(callable(getattr(driver, name, None)) for name in ("publish_wake_hint", "subscribe_wake_hints"))


def supports_operator_reads(driver: object) -> TypeGuard[OperatorReadDriver]:
    return all(callable(getattr(driver, name, None)) for name in ("get_run", "list_runs", "list_run_events"))
