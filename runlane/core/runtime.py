"""The runtime: ``create_runlane()`` and ``Runlane`` with every execution path and operator surface.

``Runlane`` owns the registries (tasks, queues), the clock and the lane, and is the only caller of the
core storage layer (``CoreStore``) for trigger, run_now, execute_next, execute_delivery, tick,
signals, idempotency keys and operator reads/actions. Every path that runs user code goes through
the shared post-lease attempt path in ``attempt.py``; the worker loops live in ``worker.py``.

Rules this module keeps:

* validation and configuration errors are raised before anything is written;
* claims, completions and heartbeats go through per-event-loop group-commit batchers, so concurrent
  worker slots share storage transactions;
* observers are called after the storage commit that persisted what they observe, with the same
  observations that commit appended to the durable observation stream, and their failures never
  affect run state;
* a trigger (or any write that makes a run due now) in this process wakes idle poll-worker slots of
  this runtime immediately instead of waiting for their empty-poll delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import builtins
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from pydantic import ValidationError

from ..defaults import contract_defaults
from ..durations import Duration, duration_ms, format_duration, later
from ..errors import ErrorCode, RunlaneError, StorageConflictKind, is_storage_conflict, pydantic_message
from ..ids import random_uuid4_hex, time_ordered_uuid_hex, validate_id
from ..json_values import canonical_json, ensure_json_object, is_unicode_text
from ..model_build import build_validated
from ..models import (
    Actor,
    DeliveryIntent,
    DeliveryMessage,
    Environment,
    OutboxFailureRecord,
    OutboxMessage,
    Page,
    RunAttemptSummary,
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEvent,
    RunEventRecord,
    RunFailedEvent,
    RunFailure,
    RunlaneObservation,
    RunLease,
    RunLeaseClaimedEvent,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunStartedEvent,
    RunStepRecord,
    RunSucceededEvent,
    RunSummary,
    ScheduleOccurrence,
    environment_key,
)
from ..run_scans import (
    get_run_attempt_timeout_finalization_available_at,
    get_run_cancellation_finalization_available_at,
    get_run_delivery_recovery_available_at,
    get_run_dispatch_available_at,
)
from ..reducer import project_run_events
from ..storage import (
    PaginationParams,
    RunEventFilter,
    RunFilter,
    StorageClockAuthority,
    StorageDriver,
    StorageIndexName,
    StorageLimitError,
    StorageWakeHints,
    TimeRange,
    clamp_page_limit,
    decode_operator_cursor,
    encode_operator_cursor,
    supports_wake_hints,
)
from ..storage.clock import SystemClock
from ..vocabulary import (
    ActorType,
    ExecuteDeliveryIgnoredReason,
    ExecuteDeliveryStatus,
    LaneDeliveryMode,
    OutboxMessageStatus,
    PaginationCursorKind,
    RunAttemptStatus,
    RunEventSortField,
    RunEventType,
    RunSortField,
    RunSourceType,
    RunStatus,
    RunWaitConditionType,
    SortDirection,
    TriggerDispatchMode,
    TriggerOutcomeType,
    WakeupPublishOutcomeType,
    WorkerMode,
    run_status_values,
)
from .attempt import (
    DRAIN_OUTAGE_LIMIT_S,
    REASON_WORKER_STOPPED,
    AttemptResult,
    CancellationRegistry,
    ExecutionOptions,
    execute_claimed_run,
    failure_outcome_events,
    log_timed_out_attempt,
    refuse_waiting_for_its_own_run,
    refuse_waiting_for_itself,
    timed_out_failure,
)
from .authoring import (
    IdempotencyKeyTtl,
    QueueDefinition,
    ScheduleDefinition,
    TaskDefinition,
    checked_actor,
    checked_reason,
    parse_idempotency_key_ttl,
)
from ..storage.batching import Batcher
from ..storage.tables import describe_record_key, run_key
from .cancellation import CancellationSignal, being_cancelled
from .lanes import Lane
from .observations import (
    ObservationExporter,
    ObservationPage,
    ObservationSink,
    ObservationTrimResult,
    get_observation_checkpoint,
    observation_for_step,
    scan_observation_records,
    trim_observation_records,
)
from .pruning import PruneResult, RunPruner, older_than_ms, resolve_older_than, resolve_prune_request
from .schedules import ScheduleMaterializer, schedule_occurrence_id, scheduled_run_id
from .transport import PublishWakeupsCommand, WakeupPublishAttempt, parse_publish_wakeups_result
from .store import (
    COMPLETION_RESUME_GRACE_MS,
    RUN_COMPLETION_WAITS_COLLECTION,
    AppendResult,
    ClaimRequest,
    ClaimResult,
    CompletionRequest,
    CoreStore,
    CreateRunPlan,
    NextClaimRequest,
    OutboxMark,
    ReserveRequest,
    capacity_partition_room,
    check_room_to_run,
    delayed_delivery_at,
    is_step_position,
    run_not_found,
    signal_wait_partition,
)

if TYPE_CHECKING:
    from ..storage.clock import Clock
    from ..vocabulary import (
        RunEventSortFieldName,
        RunEventTypeName,
        RunSortFieldName,
        RunStatusName,
        SortDirectionName,
        TriggerDispatchModeName,
        WorkerModeName,
    )
    from .sync import SyncRunlane
    from .worker import WorkerHandle

__all__ = [
    "CandidatePool",
    "ExecuteDeliveryResult",
    "IdempotencyKeysApi",
    "MAX_TRACE_CARRIER_BYTES",
    "MAX_WORKER_CONCURRENCY",
    "ObservationsApi",
    "Registry",
    "Runlane",
    "RunsApi",
    "SignalsApi",
    "TickResult",
    "TriggerRunResult",
    "create_runlane",
]

T = TypeVar("T")

_TERMINAL = run_status_values.terminal
_DIRECTLY_CANCELLABLE = run_status_values.directly_cancellable

#: A wake hint that is not a queue name: ``cancel:<run id>`` asks the process whose attempt holds the
#: run's lease to heartbeat now. ``:`` is reserved in ids, so no queue is ever called this.
CANCELLATION_HINT = "cancel:"
#: The hint of a driver that cannot carry one (SQLite: "another connection committed").
ANY_COMMIT_HINT = "*"
_SYSTEM_ACTOR = contract_defaults.actor.system
_OPERATOR_ACTOR = contract_defaults.actor.operator
_DEFAULT_LEASE_MS = duration_ms(contract_defaults.lease.duration)
_DEFAULT_EMPTY_POLL_DELAY = "100ms"
#: The most slots one worker runs. Each slot is a task on the worker's event loop, all created when the
#: worker starts: a count far past what one process can run (a typo of a few zeros) would hold the loop
#: while they are made and grow memory without bound. More concurrency comes from more processes.
MAX_WORKER_CONCURRENCY = 10_000
_MAINTENANCE = contract_defaults.maintenance
_ATTEMPT_OWNERS = frozenset({RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED})
# Outbox publishing: a claim lasts one lease duration; a retryable failure makes the row available
# again after an exponential delay (1 s, 2 s, 4 s ... capped at 5 min), for as long as the failure stays
# retryable: an outage of the transport, however long, must not cost a run its wakeup. Only a row the
# transport refuses for good (not retryable) is dead-lettered.
_OUTBOX_CLAIM_MS = _DEFAULT_LEASE_MS
_OUTBOX_RETRY_BASE_MS = 1_000
_OUTBOX_RETRY_MAX_MS = 300_000
# How often the failures of one observer are logged (without on_observer_error).
_OBSERVER_REPORT_INTERVAL_S = 60.0
# How often wakeups a transport did not take are logged, per queue and failure code.
_PUBLISH_REPORT_INTERVAL_S = 60.0
# How many runnable candidates one storage scan asks for beyond what the caller needs, so callers
# racing in this process pick different runs instead of all claiming the first one.
_SCAN_HEADROOM = 8
# Candidates one execute step tries before reporting that it could not execute anything.
_MAX_CLAIM_TRIES = 8
# A candidate of the runnable index whose run this many claims found missing or finished is set aside:
# a lost race leaves no such row behind, so its row is stale (a lost race only ever shows once).
_UNCLAIMABLE_SET_ASIDE = 3
# Candidates whose failed claims are remembered for that count (the oldest are forgotten first).
_UNCLAIMABLE_TRACKED = 1024
# Claim results that say the run behind a runnable candidate can never be claimed as it is stored.
_UNCLAIMABLE_REASONS = frozenset(
    {ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND, ExecuteDeliveryIgnoredReason.TERMINAL}
)


def _invalid(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class TriggerRunResult:
    """What ``trigger()`` did: ``outcome`` is ``created`` or ``returned_existing`` (idempotency)."""

    run: RunRecord
    outcome: TriggerOutcomeType


@dataclass(frozen=True, slots=True)
class ExecuteDeliveryResult:
    """``executed`` with the persisted run, or ``ignored`` with an ack-safe ``reason``."""

    status: ExecuteDeliveryStatus
    reason: ExecuteDeliveryIgnoredReason | None = None
    run: RunRecord | None = None


@dataclass(frozen=True, slots=True)
class TickResult:
    """Counts of one maintenance pass (phases a lane does not run report zero)."""

    materialized: int = 0
    delivery_requested: int = 0
    cancellations_finalized: int = 0
    timeouts_finalized: int = 0
    dispatch_reserved: int = 0
    outbox_published: int = 0
    outbox_failed: int = 0
    outbox_dead_lettered: int = 0


# ---------------------------------------------------------------------------------------------
# Registries


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping by name that also allows attribute access (``runlane.tasks.send_email``)."""

    __slots__ = ("_items", "_kind")
    _items: dict[str, T]
    _kind: str

    def __init__(self, items: Mapping[str, T], kind: str) -> None:
        object.__setattr__(self, "_items", dict(items))
        object.__setattr__(self, "_kind", kind)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getattr__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise AttributeError(f"No {self._kind} named {name!r} is registered; registered: {sorted(self._items)}.") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"The {self._kind} registry is read-only.")

    def __repr__(self) -> str:
        return f"Registry({self._kind}: {sorted(self._items)})"


def _clock_reading_in_utc(clock: Clock, value: object) -> datetime:
    """A reading of ``clock`` that is not a UTC datetime, in UTC; ``configuration_invalid`` naming the
    clock when it is no timezone-aware datetime (a naive one would be taken as local time)."""
    if isinstance(value, datetime) and value.tzinfo is not None and value.utcoffset() is not None:
        return value.astimezone(UTC)
    shown = f"a naive datetime ({value.isoformat()})" if isinstance(value, datetime) else f"{value!r:.80}"
    raise RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"The clock {type(clock).__name__} passed to create_runlane(clock=...) returned {shown} from now(); "
        "now() must return a timezone-aware datetime, such as datetime.now(UTC).",
        meta={"field": "clock"},
    )


def _read_clock(clock: Clock) -> object:
    """``clock.now()``; ``configuration_invalid`` naming the clock when it raises."""
    try:
        return clock.now()
    except RunlaneError:
        raise
    except Exception as error:
        raise _clock_failed(clock, error) from error


def _clock_failed(clock: Clock, error: Exception) -> RunlaneError:
    return RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"The clock {type(clock).__name__} passed to create_runlane(clock=...) raised {type(error).__name__} "
        f"from now(): {error}; fix the clock so now() returns a timezone-aware datetime.",
        meta={"field": "clock"},
        cause=error,
    )


# ---------------------------------------------------------------------------------------------
# Per-event-loop state


_observer_log = logging.getLogger("runlane.observers")
_waiter_log = logging.getLogger("runlane.runtime")
# How long resuming the waiters of a finished run is retried through a storage outage (seconds).
_WAITER_RESUME_RETRY_S = 30.0  # well within COMPLETION_RESUME_GRACE_MS, after which tick() takes over
_RESUME_GRACE = format_duration(COMPLETION_RESUME_GRACE_MS)
_transport_log = logging.getLogger("runlane.transport")
_worker_log = logging.getLogger("runlane.worker")

# Threads for ``def`` handlers are started on demand, one per handler running at that moment; the cap only
# guards against a runaway caller (worker slots and direct calls bound the attempts in flight).
_MAX_HANDLER_THREADS = 4096


class _LoopState:
    """The group-commit batchers of one event loop (the runtime can serve several loops, for example
    an application loop and the ``runlane.sync`` facade's own loop). Heartbeats and other appends share
    the completion batcher, whose results carry the persisted events observers need."""

    __slots__ = ("claims", "completions", "next_claims")

    def __init__(self, store: CoreStore, claim_next: Callable[[list[NextClaimRequest]], Any]) -> None:
        self.claims: Batcher[ClaimRequest, ClaimResult] = Batcher(store.claim, max_batch_size=64)
        self.next_claims: Batcher[NextClaimRequest, ClaimResult | None] = Batcher(claim_next, max_batch_size=64)
        # ``store.complete`` reports a failed item as a RunlaneError in its place; the batcher raises it
        # to that item's caller, so ``submit`` returns only AppendResults.
        self.completions: Batcher[CompletionRequest, AppendResult] = Batcher(store.complete, max_batch_size=64)


class _WorkSignal:
    """Same-process wake-up for idle poll slots: a generation counter plus one event per loop waiter.

    ``notify()`` may be called from any thread; waiters are woken on their own loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = 0
        self._waiters: dict[asyncio.Future[None], asyncio.AbstractEventLoop] = {}

    def notify(self) -> None:
        with self._lock:
            self.generation += 1
            if not self._waiters:
                return
            waiters = list(self._waiters.items())
            self._waiters.clear()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for future, loop in waiters:
            if loop is running:
                if not future.done():
                    future.set_result(None)
            else:
                try:
                    loop.call_soon_threadsafe(_wake_future, future)
                except RuntimeError:
                    pass  # that loop is closed; nothing waits on it any more

    async def wait(self, generation: int, timeout: float, stop: CancellationSignal) -> None:
        """Wait until notified after ``generation``, ``timeout`` seconds pass, or ``stop`` aborts."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.generation != generation:
                return
            self._waiters[future] = loop
        remove = stop.add_callback(lambda: loop.call_soon_threadsafe(_wake_future, future))
        timer = loop.call_later(timeout, _wake_future, future)
        try:
            await future
        finally:
            timer.cancel()
            remove()
            with self._lock:
                self._waiters.pop(future, None)


def _wake_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# ---------------------------------------------------------------------------------------------
# The runtime


class CandidatePool:
    """Runnable candidates from one storage scan, shared by the callers of one worker.

    Only one scan runs at a time per pool: callers that find it empty while a scan is in flight
    wait for that scan instead of issuing their own. With an ``idle_window`` (a poll worker's
    ``empty_poll_delay``), a scan that found nothing due also answers the callers that come within
    that many seconds, unless a wake-up came since (``generation``): the idle slots of one worker
    then scan storage about once per poll delay between them, not once each.
    """

    __slots__ = ("_idle_mark", "_idle_window", "_items", "_scan_generation", "_scan_size", "_scanning", "_thorough")

    def __init__(self, scan_size: int, idle_window: float = 0.0, *, thorough: bool = True) -> None:
        """``thorough``: a scan that finds nothing has read all of a bounded queue's due rows, so "nothing"
        ends the caller's work (a drain, ``execute_next``) only when no run could start; a poll worker,
        which scans again, reads a bounded window behind a full partition's backlog per scan instead."""
        self._items: list[str] = []
        self._thorough = thorough
        self._scan_size = scan_size
        self._scanning: asyncio.Future[bool] | None = None
        self._scan_generation: int | None = None  # the work signal's when the scan in flight started
        self._idle_window = idle_window
        self._idle_mark: tuple[int, float] | None = None  # (work generation, loop time) of the last idle scan

    def take(self, claiming: set[str], set_aside: Collection[str] = ()) -> str | None:
        items = self._items
        while items:
            candidate = items.pop()
            if candidate not in claiming and candidate not in set_aside:
                return candidate
        return None

    async def refill(
        self, store: CoreStore, queues: Sequence[str], now: datetime, claiming: set[str], generation: int | None = None
    ) -> bool | None:
        """Scan once (or join the scan in flight); ``None`` when storage has no due candidate at all.
        ``generation``: the work signal's, read before the call (see ``idle_window``).

        A scan in flight that finds nothing answers only the callers that knew no more than it did when
        it started: one that a wake-up reached since (a run of its own finished and freed bounded-queue
        capacity, say) scans again itself, or a drain slot would end with runs left it could take."""
        while (scanning := self._scanning) is not None:
            started = self._scan_generation
            if await asyncio.shield(scanning):
                return True
            if generation is None or generation == started:
                return None
        loop = asyncio.get_running_loop()
        mark = self._idle_mark
        if mark is not None and mark[0] == generation and loop.time() - mark[1] < self._idle_window:
            return None  # another slot found nothing due a moment ago, and nothing woke the worker since
        future: asyncio.Future[bool] = loop.create_future()
        self._scanning = future
        self._scan_generation = generation
        try:
            refs = await store.list_runnable(queues, now, len(claiming) + self._scan_size, thorough=self._thorough)
            fresh = [ref.run_id for ref in refs if ref.run_id not in claiming]
            fresh.reverse()  # take() pops from the end: oldest first
            self._items = fresh
            self._idle_mark = None if refs or generation is None or not self._idle_window else (generation, loop.time())
            future.set_result(bool(refs))
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved here; joiners re-raise it
            raise
        finally:
            self._scanning = None
        return True if refs else None


@dataclass(frozen=True, slots=True)
class _CreateInput:
    """Validated trigger options shared by trigger, run_now and child triggers."""

    definition: TaskDefinition
    queue: QueueDefinition
    payload: Any
    actor: Actor
    run_id: str
    concurrency_key: str | None
    idempotency_key: str | None
    idempotency_key_ttl: IdempotencyKeyTtl | None
    singleton_key: str | None
    meta: dict[str, Any] | None
    trace_carrier: dict[str, str] | None
    source: RunSource | None
    generated_run_id: bool = False  # core drew ``run_id`` (the caller passed none)
    run_at: datetime | None = None  # a delayed trigger's start time, in the future when it was prepared


class Runlane:
    """A runtime over one lane, a queue registry and a task catalog. Build it with ``create_runlane()``."""

    def __init__(
        self,
        *,
        lane: Lane,
        queues: Mapping[str, QueueDefinition],
        tasks: Mapping[str, TaskDefinition],
        tasks_by_id: Mapping[str, TaskDefinition],
        default_queue: QueueDefinition | None,
        environment: Environment,
        dispatch: TriggerDispatchMode,
        clock: Clock,
        worker_id: str,
        observers: Sequence[Callable[[RunlaneObservation], Any]],
        on_observer_error: Callable[[BaseException, RunlaneObservation], Any] | None,
    ) -> None:
        self._lane = lane
        self._queues: Registry[QueueDefinition] = Registry(queues, "queue")
        self._tasks: Registry[TaskDefinition] = Registry(tasks, "task")
        self._tasks_by_id = dict(tasks_by_id)
        self._default_queue = default_queue
        self._environment = environment
        self._env_key = environment_key(environment)
        self._dispatch = dispatch
        self._clock = clock
        self._worker_id = worker_id
        self._observers = tuple(observers)
        self._on_observer_error = on_observer_error
        self._store = CoreStore(
            lane.storage,
            environment,
            queue_limits={q.name: q.concurrency_limit for q in queues.values() if q.concurrency_limit is not None},
            outbox=lane.delivery.mode is LaneDeliveryMode.TRANSPORT,
            observing=bool(self._observers),
        )
        self._any_task_deadline = any(t.max_attempt_duration_ms is not None for t in self._tasks_by_id.values())
        # Every registered schedule with its task, in registration order (ids are unique: create_runlane).
        self._schedules: tuple[tuple[ScheduleDefinition, TaskDefinition], ...] = tuple(
            (item, definition) for definition in self._tasks_by_id.values() for item in definition.schedules
        )
        self._materializer = ScheduleMaterializer(lane.storage, environment)
        self._dispatch_turn = 0  # the bounded queue whose turn it is to be served first (see _dispatch_bounded)
        self._loop_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
        self._last: tuple[asyncio.AbstractEventLoop, _LoopState] | None = None
        self._state_lock = threading.Lock()
        # ``runs.wait`` callers by run id: woken when this process commits that run's terminal outcome.
        self._finish_waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._started = False
        self._closed = False
        self._closed_at_exit = False  # closed by the runlane.sync exit hook, not by the application
        self._forked_from: int | None = None  # in a child forked after the lane started: the parent's pid
        self._started_on: asyncio.AbstractEventLoop | None = None  # the loop the lane was started on
        # Per observer without on_observer_error: when its failure was last logged, and how many since.
        self._observer_failures: dict[int, tuple[float, int]] = {}
        # Per queue and failure code of wakeups not published: when last logged, and how many since.
        self._publish_failures: dict[tuple[str, str], tuple[datetime, int]] = {}
        # The start in progress, for the callers that come meanwhile, from any thread and event loop.
        self._starting: concurrent.futures.Future[None] | None = None
        self._workers: set[WorkerHandle] = set()
        self._claiming: set[str] = set()
        # Candidate run id -> claims that found it missing or finished (see ``_note_claim``).
        self._unclaimable: dict[str, int] = {}
        # Finished source runs whose waiters tick() could not resume (see ``_resume_overdue_waiters``).
        self._stuck_resumes: set[str] = set()
        self.work_signal = _WorkSignal()
        # Cross-process wake-up hints when the storage driver offers them (see ``wake``).
        self._wake_hints: StorageWakeHints | None = lane.storage if supports_wake_hints(lane.storage) else None
        # Drivers with exclusive candidates let a worker of unbounded queues scan and claim in one
        # transaction that other processes' scans skip (``claim_next``); other workers share a plain
        # scan per worker, deep enough to get past bounded-queue runs that wait for capacity.
        self._exclusive_claims = bool(getattr(lane.storage.profile, "exclusive_candidates", False))
        self.registry = CancellationRegistry()
        self._store.holds_lease = self.registry.holds
        self.runs = RunsApi(self)
        self.signals = SignalsApi(self)
        self.idempotency_keys = IdempotencyKeysApi(self)
        self.observations = ObservationsApi(self)
        self._sync: SyncRunlane | None = None
        self._handler_threads: concurrent.futures.ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._started else "new")
        return f"Runlane(lane={self._lane.name!r}, environment={self._environment.name!r}, {state})"

    # -- registries and properties ---------------------------------------------------------------

    @property
    def lane(self) -> Lane:
        return self._lane

    @property
    def tasks(self) -> Registry[TaskDefinition]:
        return self._tasks

    @property
    def queues(self) -> Registry[QueueDefinition]:
        return self._queues

    @property
    def environment(self) -> Environment:
        return self._environment

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def dispatch(self) -> TriggerDispatchMode:
        return self._dispatch

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def store(self) -> CoreStore:
        """The core storage layer this runtime writes through (for tooling and tests)."""
        return self._store

    @property
    def sync(self) -> SyncRunlane:
        """The blocking facade (``runlane.sync.trigger(...)``), running on its own event-loop thread."""
        if self._sync is None:
            from .sync import SyncRunlane

            with self._state_lock:
                if self._sync is None:
                    self._sync = SyncRunlane(self)
        return self._sync

    def observation_exporter(
        self, consumer: str, sink: ObservationSink, *, batch_size: int = 100
    ) -> ObservationExporter:
        """An exporter that moves this environment's observation records to ``sink`` for ``consumer``,
        at least once (``await exporter.export_once()`` or ``await exporter.run(signal=...)``).

        Run one active exporter per consumer; give independent sinks their own consumer names.
        """
        self._check_open()
        # The exporter only reads and writes through get/query/with_transaction; the runtime keeps
        # start/close of the driver to itself.
        storage = cast(StorageDriver, _ReadyStorage(self))
        return ObservationExporter(storage, self._environment, consumer, sink, batch_size=batch_size, clock=self._clock)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the lane (storage, then transport). Calling it again is a no-op."""
        self._check_open()
        # One start at a time, whatever the threads and event loops calling (an application's loop, the
        # runlane.sync facade's, a thread's asyncio.run()): an asyncio lock would be bound to the first loop
        # waiting on it and refuse the others.
        while not self._started:
            with self._state_lock:
                starting = self._starting
                first = starting is None
                if starting is None:
                    starting = self._starting = concurrent.futures.Future()
                    starting.set_running_or_notify_cancel()  # a waiter given up on cannot cancel it
            if not first:
                await asyncio.wrap_future(starting)
                continue  # started, or that start failed: this caller tries it again
            try:
                self._check_open()
                _STARTED_RUNTIMES.add(self)  # from now on: a child forked during the start gets half of it
                await self._lane.start()
                self._started = True
                self._started_on = asyncio.get_running_loop()
            finally:
                with self._state_lock:
                    self._starting = None
                starting.set_result(None)

    async def close(self) -> None:
        """Stop this runtime's workers and running attempts, wait for them, then close the lane. Later
        calls raise ``configuration_invalid``.

        Attempts of ``execute_next()``, ``run_now()`` and ``execute_delivery()`` still running are
        stopped as a worker stop stops its own: ``ctx.signal`` is aborted with ``worker_stopped``, and
        their outcomes are written before the lane closes."""
        if self._closed:
            return
        refuse_waiting_for_itself(self, "runlane.close()")
        for worker in self._workers:
            worker.refuse_in_own_slot("runlane.close()")
        self._closed = True
        self._wake_finish_waiters()  # a pending runs.wait() ends now, saying the runtime is closed
        workers = list(self._workers)
        for worker in workers:
            worker.request_stop()
        await self.registry.stop_all(REASON_WORKER_STOPPED)
        for worker in workers:
            try:
                await worker.wait_closed()
            except Exception:
                pass  # a failed worker reports through its own handle; closing goes on
        if self._started:
            self._started = False
            await self._lane.close()
        if self._sync is not None:
            self._sync.shutdown_loop()
        if self._handler_threads is not None:
            self._handler_threads.shutdown(wait=False)  # workers waited for their attempts above

    async def __aenter__(self) -> Runlane:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if not self._closed:  # a forked child's runtime, and one closed at exit, are closed too
            return
        if self._forked_from is not None:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"This Runlane runtime was started in process {self._forked_from}, and this process was forked "
                "from it afterwards: its connections and event loops stay with that process. Do not start or "
                "use the runtime before the fork (at import, in the master process): creating it there is "
                "fine, and each process then starts its own after the fork, on first use (or in a lifespan or "
                "post_fork hook).",
                meta={"parent_pid": self._forked_from},
            )
        if self._closed_at_exit:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                "This Runlane runtime was closed as the process exits: runlane.sync closes it in the atexit hook "
                "it registers when runlane is imported, and this call came after that (from an atexit hook "
                "registered before runlane was imported, say: hooks run in reverse order of registration). "
                "Register that hook after importing runlane to make calls from it.",
            )
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            "This Runlane runtime is closed; create a new runtime with create_runlane() to keep working.",
        )

    def _forked(self, parent: int) -> None:
        """In a child process forked after the lane started (or while it was starting): every call is
        refused, and ``close()`` leaves the parent's connections alone."""
        self._forked_from = parent
        self._closed = True
        self._started = False
        self._workers.clear()
        if self._sync is not None:
            self._sync.forked()

    async def _ready(self) -> None:
        if self._closed:
            self._check_open()
        if not self._started:
            await self.start()

    # -- internals shared with attempt.py and worker.py ------------------------------------------

    def now(self) -> datetime:
        value = _read_clock(self._clock)
        if isinstance(value, datetime) and value.tzinfo is UTC:
            return value
        return _clock_reading_in_utc(self._clock, value)

    def loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        # One tuple, read and written as a unit, so two threads' loops can never mix their batchers.
        last = self._last
        if last is not None and last[0] is loop:
            return last[1]
        with self._state_lock:
            state = self._loop_states.get(loop)
            if state is None:
                state = _LoopState(self._store, self._claim_next)
                self._loop_states[loop] = state
        self._last = (loop, state)
        return state

    @property
    def handler_threads(self) -> concurrent.futures.Executor:
        """Where ``def`` handlers run: one pool for the runtime, which starts a thread whenever every
        thread it has is busy, so as many sync handlers run at once as attempts are in flight (worker
        slots plus direct callers). The event loop's default executor would stop at ``min(32, CPUs + 4)``
        threads: a worker's other slots would hold leases for runs whose handlers wait for a thread, and
        the wait would count against their attempt deadlines."""
        threads = self._handler_threads
        if threads is None:
            with self._state_lock:
                threads = self._handler_threads
                if threads is None:
                    threads = self._handler_threads = concurrent.futures.ThreadPoolExecutor(
                        max_workers=_MAX_HANDLER_THREADS, thread_name_prefix="runlane-handler"
                    )
        return threads

    def renew_handler_threads(self, failed: concurrent.futures.Executor) -> None:
        """Leave the handler threads pool a submission to failed (no thread could be started): that pool
        counts a thread as idle that is not, and would queue the next handler behind a busy one. Its
        threads finish what they run; the next handler gets a new pool."""
        with self._state_lock:
            if self._handler_threads is not failed:
                return
            self._handler_threads = None
        failed.shutdown(wait=False)

    def task_for(self, task_id: str) -> TaskDefinition | None:
        return self._tasks_by_id.get(task_id)

    def register_worker(self, worker: WorkerHandle) -> None:
        self._workers.add(worker)

    def unregister_worker(self, worker: WorkerHandle) -> None:
        self._workers.discard(worker)

    # -- observers -------------------------------------------------------------------------------

    @property
    def has_observers(self) -> bool:
        return bool(self._observers)

    def attach_observers(self, observers: Sequence[Callable[[RunlaneObservation], Any]]) -> None:
        """Add live observers to a runtime someone else built (plugin observers for a ``runtime =``
        factory in ``runlane.toml``); one already attached is not added twice."""
        added = tuple(observer for observer in dict.fromkeys(observers) if observer not in self._observers)
        if added:
            self._observers += added
            self._store.observing = True

    async def observe(self, observations: Sequence[RunlaneObservation]) -> None:
        """Tell every observer about ``observations`` of one commit (the same values the commit appended
        to the durable observation stream); failures are isolated."""
        if not self._observers:
            return
        for observation in observations:
            await self._notify_observers(observation)

    async def observe_step(self, step: RunStepRecord, run: RunRecord | None = None) -> None:
        """Tell every observer about a first-time step completion (already committed)."""
        if not self._observers:
            return
        await self._notify_observers(observation_for_step(step, run))

    async def _notify_observers(self, observation: RunlaneObservation) -> None:
        for observer in self._observers:
            try:
                result = observer(observation)
                if inspect.isawaitable(result):
                    await result
            except (Exception, SystemExit) as error:  # sys.exit() in an observer must not end the worker
                await self._report_observer_error(observer, error, observation)
            except asyncio.CancelledError as error:
                if being_cancelled():
                    raise  # the caller's task is being cancelled: not the observer's failure
                # The observer let a cancellation of something it awaited escape: its failure, not the
                # caller's (a trigger() that committed must not look as if it had failed).
                await self._report_observer_error(observer, error, observation)

    async def _report_observer_error(
        self, observer: Any, error: BaseException, observation: RunlaneObservation
    ) -> None:
        """Hand an observer's failure to ``on_observer_error``, or log it when there is none (or when
        that fails too). Run state is already durable either way."""
        what = observation.event_type or observation.type
        fields = {"run_id": observation.run_id, "task_id": observation.task_id}
        handler = self._on_observer_error
        if handler is None:
            # At most one report per observer per minute: an observer that fails on every event would
            # otherwise write a traceback for each.
            now = time.monotonic()
            logged_at, unreported = self._observer_failures.get(id(observer), (None, 0))
            if logged_at is not None and now - logged_at < _OBSERVER_REPORT_INTERVAL_S:
                self._observer_failures[id(observer)] = (logged_at, unreported + 1)
                return
            self._observer_failures[id(observer)] = (now, 0)
            since = f" (and {unreported} more time(s) since it was last reported)" if unreported else ""
            hint = getattr(observer, "failure_hint", None) or (
                "Pass on_observer_error= to create_runlane() to handle observer failures yourself."
            )
            _observer_log.warning(
                "Observer %r raised on %s of run %s%s; the run is unaffected. %s",
                observer, what, observation.run_id, since, hint, exc_info=error, extra=fields,
            )  # fmt: skip
            return
        try:
            result = handler(error, observation)
            if inspect.isawaitable(result):
                await result
        except (Exception, SystemExit, asyncio.CancelledError) as handler_error:
            if isinstance(handler_error, asyncio.CancelledError) and being_cancelled():
                raise
            _observer_log.error(
                "on_observer_error raised while handling the failure of observer %r on %s of run %s "
                "(the observer raised %s: %s).",
                observer, what, observation.run_id, type(error).__name__, error, exc_info=handler_error,
                extra=fields,
            )  # fmt: skip

    # -- write helpers ---------------------------------------------------------------------------

    def wake(self, queue: str, *, hinted: bool = False) -> None:
        """A run of ``queue`` became due now: wake this process's idle poll slots, and other
        processes' through the storage driver's wake hints when it has them (``hinted``: the commit
        already carried the hint)."""
        self.work_signal.notify()
        if self._wake_hints is not None and not hinted:
            self._wake_hints.publish_wake_hint(queue)

    def hint_cancellation(self, run_id: str) -> None:
        """Tell other processes, through the driver's wake hints if it has them, that ``run_id`` has a
        cancellation request its attempt should observe now."""
        if self._wake_hints is not None:
            self._wake_hints.publish_wake_hint(CANCELLATION_HINT + run_id)

    def subscribe_wake_hints(self) -> Callable[[], None] | None:
        """Let other processes' hints wake this process's idle poll slots, and make its attempts of a run
        whose cancellation another process requested heartbeat at once (``None``: no hints)."""
        if self._wake_hints is None:
            return None
        notify = self.work_signal.notify
        registry = self.registry

        def on_hint(hint: str) -> None:
            if hint.startswith(CANCELLATION_HINT):
                registry.check_now(hint[len(CANCELLATION_HINT) :])
                return
            notify()
            if hint == ANY_COMMIT_HINT:  # a driver that cannot say what changed: maybe a cancellation
                registry.check_all_soon()

        return self._wake_hints.subscribe_wake_hints(on_hint)

    async def after_append(self, result: AppendResult) -> None:
        """Everything that follows a committed append: observers, completion waiters, wake-ups."""
        if result.events:
            if self._observers:
                await self.observe(result.observations)
            run = result.run
            if self._finish_waiters and run_status_values.is_terminal(run.status):
                self._wake_finish_waiters(run.id)
            if run.status is RunStatus.QUEUED:
                if result.events[-1].event.type is RunEventType.DELIVERY_REQUESTED:
                    self.wake(run.queue)
            elif run.queue in self._store.queue_limits and run.status not in _ATTEMPT_OWNERS:
                self.wake(run.queue)  # bounded-queue capacity was freed
        if result.completion_waiters:
            await self._resume_waiters_riding_out(result.run.id)

    def _wake_finish_waiters(self, run_id: str | None = None) -> None:
        """Wake the ``runs.wait()`` calls for ``run_id`` (``None``: every one, as the runtime closes)."""
        with self._state_lock:
            if run_id is None:
                waiters: Iterable[asyncio.Future[None]] = [f for group in self._finish_waiters.values() for f in group]
            else:
                waiters = self._finish_waiters.pop(run_id, ())
        for future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody is waiting any more
                future.get_loop().call_soon_threadsafe(_wake_future, future)

    @contextlib.contextmanager
    def _finish_waiter(self, run_id: str) -> Iterator[asyncio.Future[None]]:
        """A future this process's commit of ``run_id``'s terminal outcome completes (see ``runs.wait``)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._state_lock:
            self._finish_waiters.setdefault(run_id, set()).add(future)
        try:
            yield future
        finally:
            with self._state_lock:
                waiters = self._finish_waiters.get(run_id)
                if waiters is not None:
                    waiters.discard(future)
                    if not waiters:
                        del self._finish_waiters[run_id]

    async def _resume_waiters_riding_out(self, source_run_id: str) -> None:
        """``resume_completion_waiters`` after the source's terminal commit, retried through a short
        storage outage: that commit stands whatever happens here, so an outage must neither strand the
        waiters at its first failure nor be reported as the failure of a write that succeeded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _WAITER_RESUME_RETRY_S
        delay = 0.05
        while True:
            try:
                await self.resume_completion_waiters(source_run_id)
                await self._store.completion_resumed(source_run_id)
                return
            except RunlaneError as error:
                if not error.retryable or loop.time() + delay > deadline:
                    _waiter_log.error(
                        "Run %s finished, but the runs waiting for it (wait_for_run) could not be resumed: "
                        "%s: %s. tick() resumes them from %s after it finished.",
                        source_run_id, error.code.value, error.message, _RESUME_GRACE,
                        extra={"run_id": source_run_id, "error_code": error.code.value},
                    )  # fmt: skip
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def append_many(self, requests: Sequence[CompletionRequest]) -> list[AppendResult | RunlaneError]:
        """Batched appends through this loop's completion batcher, each followed by ``after_append``."""
        batcher = self.loop_state().completions
        if len(requests) == 1:
            try:
                results: list[Any] = [await batcher.submit(requests[0])]
            except RunlaneError as error:
                results = [error]
        else:
            results = list(await asyncio.gather(*(batcher.submit(request) for request in requests), return_exceptions=True))
        for result in results:
            if isinstance(result, AppendResult):
                await self.after_append(result)
            elif not isinstance(result, RunlaneError):
                raise result
        return results

    async def publish_resumed(self, results: Sequence[AppendResult | RunlaneError]) -> None:
        """Publish at once the wakeups of runs a signal or a finished run has resumed, on a transport lane
        with eager dispatch, as ``trigger()`` does for a new run: resumes are event-driven, and waiting
        for ``tick()`` would delay them by its interval. The resume is committed whatever happens here;
        a wakeup that cannot be published now stays in the outbox for ``tick()``."""
        if self._dispatch is not TriggerDispatchMode.EAGER or not self._store.outbox:
            return
        ids = [message.id for result in results if isinstance(result, AppendResult) for message in result.outbox]
        if not ids:
            return
        try:
            await self.publish_outbox(ids)
        except RunlaneError as error:
            _transport_log.warning(
                "Could not publish the wakeups of %d resumed runs now (%s: %s); tick() publishes them.",
                len(ids), error.code.value, error.message, extra={"error_code": error.code.value},
            )  # fmt: skip

    async def resume_completion_waiters(self, source_run_id: str) -> list[RunRecord]:
        """Append ``run.delivery_requested`` to every run still waiting for ``source_run_id`` to finish."""
        resumed: list[RunRecord] = []
        failure: RunlaneError | None = None  # the first resume that could not be written, raised at the end
        limit = self._store.driver.profile.limits.max_query_results
        # Each waiter is tried once per scan. One that stopped waiting meanwhile (cancelled, resumed by
        # its timeout) makes its append a no-op and leaves the index, so a page of only such waiters
        # does not end the scan: the next page holds the waiters past it.
        tried: set[str] = set()
        while True:
            found = await self._store.query_index(
                StorageIndexName.RUNS_WAITING_FOR_COMPLETION, (source_run_id,), limit=limit
            )
            run_ids = [run_id for run_id in found if run_id not in tried]
            if not run_ids:
                break
            tried.update(run_ids)
            build = _resume_build(
                lambda wait: wait.type is RunWaitConditionType.RUN_COMPLETION and wait.run_id == source_run_id
            )
            results = await self.append_many([CompletionRequest(run_id, build) for run_id in run_ids])
            await self.publish_resumed(results)
            for result in results:
                if isinstance(result, AppendResult) and result.events:
                    resumed.append(result.run)
                elif isinstance(result, RunlaneError) and failure is None:
                    failure = result
            if len(found) < limit:
                break
        if failure is not None:
            raise failure  # the waiters left are still in the index: a retry resumes exactly them
        return resumed

    # -- creating runs ---------------------------------------------------------------------------

    def resolve_task(self, task: object) -> TaskDefinition:
        if isinstance(task, TaskDefinition):
            registered = self._tasks_by_id.get(task.id)
            if registered is not task:
                if registered is None:
                    raise RunlaneError(
                        ErrorCode.TASK_NOT_FOUND,
                        f"Task {task.id!r} is not registered in this runtime; add it to create_runlane(tasks=...).",
                        meta={"task_id": task.id},
                    )
                raise RunlaneError(
                    ErrorCode.TASK_NOT_FOUND,
                    f"Task {task.id!r} is registered in this runtime as a different definition; "
                    "trigger the registered object (runlane.tasks...) instead of a copy.",
                    meta={"task_id": task.id},
                )
            return task
        if isinstance(task, str):
            found = self._tasks_by_id.get(task) or self._tasks._items.get(task)
            if found is None:
                raise RunlaneError(
                    ErrorCode.TASK_NOT_FOUND,
                    f"No task {task!r} is registered in this runtime; registered task ids: {sorted(self._tasks_by_id)}.",
                    meta={"task_id": task},
                )
            return found
        raise _invalid(f"task must be a TaskDefinition (from @task) or a registered task id, got {task!r}.", field="task")

    def resolve_queue(self, value: object, what: str = "queue") -> QueueDefinition:
        if isinstance(value, QueueDefinition):
            registered = self._queues._items.get(value.name)
            if registered is None:
                raise _invalid(
                    f"Queue {value.name!r} is not registered in this runtime; add it to create_runlane(queues=...).",
                    field=what,
                    queue=value.name,
                )
            if registered is not value and registered != value:
                raise _invalid(
                    f"Queue {value.name!r} differs from the registered definition (drift); use the registered queue.",
                    field=what,
                    queue=value.name,
                )
            return registered
        if isinstance(value, str):
            registered = self._queues._items.get(value)
            if registered is None:
                raise _invalid(
                    f"Queue {value!r} is not registered in this runtime; registered queues: {sorted(self._queues)}. "
                    f"Name one of those, or register queue({value!r}) (in create_runlane(queues=...), or in a module "
                    "that runlane.toml's tasks names) for as long as runs wait in it.",
                    field=what,
                    queue=value,
                )
            return registered
        raise _invalid(f"{what} must be a queue(...) definition or a registered queue name, got {value!r}.", field=what)

    def resolve_queues(self, queues: object) -> tuple[str, ...]:
        if queues is None:
            return tuple(self._queues)
        return self._queue_names(queues, lambda item: self.resolve_queue(item, "queues").name, "registered queue")

    def filter_queue_names(self, queues: object) -> tuple[str, ...]:
        """The queue names a listing filters by. A name need not be registered: runs of a queue an
        earlier release had (renamed or removed since) stay in storage, and operators must find them to
        cancel or rerun them, as with task ids. A ``queue(...)`` definition is checked like any other."""

        def name_of(item: object) -> str:
            if isinstance(item, str):
                return validate_id(item, "queue name", code=ErrorCode.VALIDATION_FAILED)
            if isinstance(item, QueueDefinition):  # an unregistered or drifted one is configuration_invalid
                return self.resolve_queue(item, "queues").name
            # A malformed filter value, as a bad name is: validation_failed (a definition is checked as
            # configuration everywhere, so it keeps configuration_invalid above).
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"queues must list queue(...) definitions or queue names, got {item!r:.80}.",
                meta={"field": "queues"},
            )

        # An empty filter matches no run, as empty statuses and task_ids do.
        names = self._queue_names(queues, name_of, "queue", code=ErrorCode.VALIDATION_FAILED, empty=True)
        if len(names) > _MAX_FILTER_VALUES:
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"A run listing filters by at most {_MAX_FILTER_VALUES:,} queues, got {len(names):,}; "
                "list fewer at a time, or list without the filter.",
                meta={"field": "queues"},
            )
        return names

    @staticmethod
    def _queue_names(
        queues: object,
        name_of: Callable[[object], str],
        what: str,
        *,
        code: ErrorCode = ErrorCode.CONFIGURATION_INVALID,
        empty: bool = False,
    ) -> tuple[str, ...]:
        """``name_of`` each of ``queues`` (one queue, or several), each name once; at least one unless
        ``empty``. ``code`` is that of a malformed ``queues``: a worker's option, or a listing's filter
        (``validation_failed``)."""
        if isinstance(queues, (str, QueueDefinition)):
            queues = [queues]
        if not isinstance(queues, Iterable):
            message = f"queues must be a list of queue definitions or names, got {queues!r:.80}."
            raise RunlaneError(code, message, meta={"field": "queues"})
        names = tuple(dict.fromkeys(name_of(item) for item in queues))
        if not names and not empty:
            message = f"queues must name at least one {what} (omit it for all queues)."
            raise RunlaneError(code, message, meta={"field": "queues"})
        return names

    def prepare_create(
        self,
        task: object,
        payload: Any,
        *,
        actor: Actor | None = None,
        concurrency_key: str | None = None,
        idempotency_key: str | None = None,
        idempotency_key_ttl: Duration | str | None = None,
        meta: Mapping[str, Any] | None = None,
        queue: QueueDefinition | str | None = None,
        run_id: str | None = None,
        singleton_key: str | None = None,
        trace_carrier: Mapping[str, str] | None = None,
        run_at: datetime | None = None,
        delay: Duration | None = None,
        source: RunSource | None = None,
        stored: bool = False,
        linked: bool = False,
    ) -> _CreateInput:
        """Validate everything a new run needs; raises before anything is written.

        ``stored=True`` takes ``payload`` as a persisted JSON payload (linked reruns) and resolves no
        task-level idempotency key: an operator asking for new work is not a duplicate trigger.
        ``linked=True`` (an operator's rerun or retry) drops a concurrency key the selected queue cannot
        enforce instead of refusing it: the keys apply where the lane can enforce them.
        """
        definition = self.resolve_task(task)
        validated = definition.load_payload(payload) if stored else definition.validate_payload(payload)
        stored_payload = definition.dump_payload(validated)

        if queue is not None:
            selected = self.resolve_queue(queue)
        elif definition.queue is not None:
            selected = self.resolve_queue(definition.queue)
        elif self._default_queue is not None:
            selected = self._default_queue
        else:
            raise _invalid(
                f"Task {definition.id!r} has no queue and no registered queue is marked default; pass queue= "
                "to this call (--queue on the command line) or to the task, or mark one queue default=True.",
                field="queue",
                task_id=definition.id,
            )

        actor = checked_actor(actor, _SYSTEM_ACTOR)

        keys: dict[str, str | None] = {}
        for kind, explicit in (
            ("idempotency_key", idempotency_key),
            ("singleton_key", singleton_key),
            ("concurrency_key", concurrency_key),
        ):
            label = kind.replace("_", " ")
            if explicit is not None:
                keys[kind] = validate_id(explicit, label)
            elif stored and kind == "idempotency_key":
                keys[kind] = None
            else:
                keys[kind] = definition.resolve_key(kind, validated)  # type: ignore[arg-type]
        if keys["concurrency_key"] is not None and not selected.is_bounded and linked:
            keys["concurrency_key"] = None
        elif keys["concurrency_key"] is not None and not selected.is_bounded:
            raise _invalid(
                f"A concurrency key partitions a bounded queue, but queue {selected.name!r} has no concurrency_limit; "
                "set concurrency_limit on the queue or remove the concurrency key.",
                field="concurrency_key",
            )

        ttl: IdempotencyKeyTtl | None = None
        if idempotency_key_ttl is not None:
            ttl = parse_idempotency_key_ttl(idempotency_key_ttl)
            if keys["idempotency_key"] is None:
                raise _invalid(
                    "idempotency_key_ttl needs an idempotency key (on the task or this call); set one or remove the ttl.",
                    field="idempotency_key_ttl",
                )
        elif keys["idempotency_key"] is not None:
            ttl = definition.idempotency_key_ttl

        meta_value = None
        if meta is not None:
            meta_value = _copy_json_object(meta, "meta")
        carrier = _trace_carrier(trace_carrier)
        start = self._start_time(run_at, delay)
        new_run_id = f"run_{time_ordered_uuid_hex()}" if run_id is None else validate_id(run_id, "run id")
        return _CreateInput(
            definition=definition,
            queue=selected,
            payload=stored_payload,
            actor=actor,
            run_id=new_run_id,
            concurrency_key=keys["concurrency_key"],
            idempotency_key=keys["idempotency_key"],
            idempotency_key_ttl=ttl if keys["idempotency_key"] is not None else None,
            singleton_key=keys["singleton_key"],
            meta=meta_value,
            trace_carrier=carrier,
            source=source,
            generated_run_id=run_id is None,
            run_at=start,
        )

    def _start_time(self, run_at: datetime | None, delay: Duration | None) -> datetime | None:
        """When a delayed trigger's run may start (``None``: at once, as for a time already past)."""
        if run_at is None and delay is None:
            return None
        if run_at is not None and delay is not None:
            raise _invalid("Pass run_at or delay, not both: each says when the run may start.", field="run_at")
        now = self.now()
        if delay is not None:
            start = later(now, duration_ms(delay, "delay"))
        elif not isinstance(run_at, datetime) or run_at.tzinfo is None or run_at.utcoffset() is None:
            raise _invalid(
                f"run_at must be a timezone-aware datetime, got {run_at!r}; attach a tzinfo such as UTC.",
                field="run_at",
            )
        else:
            try:
                start = run_at.astimezone(UTC)
            except OverflowError:  # datetime(9999, 12, 31, 23, tzinfo=-05:00) is past the year 9999 in UTC
                raise _invalid(
                    f"run_at {run_at!r} is out of range in UTC (years 1 to 9999); pass a time within it.",
                    field="run_at",
                ) from None
        return start if start > now else None

    def _created_event(self, spec: _CreateInput, now: datetime) -> RunCreatedEvent:
        carrier = spec.trace_carrier
        if (
            type(now) is datetime
            and now.tzinfo is UTC
            and (carrier is None or all(type(k) is str and type(v) is str for k, v in carrier.items()))
        ):
            # prepare_create validated every part (ids, keys, JSON payload and meta, carrier) and
            # ``now`` is UTC: build the event without validating it again.
            return build_validated(
                RunCreatedEvent,
                {
                    "run_id": spec.run_id,
                    "environment": self._environment,
                    "occurred_at": now,
                    "actor": spec.actor,
                    "trace_carrier": carrier,
                    "meta": spec.meta,
                    "task_id": spec.definition.id,
                    "queue": spec.queue.name,
                    "payload": spec.payload,
                    "concurrency_key": spec.concurrency_key,
                    "idempotency_key": spec.idempotency_key,
                    "idempotency_key_ttl": spec.idempotency_key_ttl,
                    "singleton_key": spec.singleton_key,
                    "source": spec.source,
                    "run_at": spec.run_at,
                },
            )
        return RunCreatedEvent(
            run_id=spec.run_id,
            environment=self._environment,
            occurred_at=now,
            actor=spec.actor,
            trace_carrier=spec.trace_carrier,
            meta=spec.meta,
            task_id=spec.definition.id,
            queue=spec.queue.name,
            payload=spec.payload,
            concurrency_key=spec.concurrency_key,
            idempotency_key=spec.idempotency_key,
            idempotency_key_ttl=spec.idempotency_key_ttl,
            singleton_key=spec.singleton_key,
            source=spec.source,
            run_at=spec.run_at,
        )

    def _creation_events(self, spec: _CreateInput, now: datetime) -> tuple[RunCreatedEvent, tuple[RunEvent, ...]]:
        """``run.created`` of a prepared trigger, and ``run.delivery_requested`` after it on an unbounded queue."""
        created = self._created_event(spec, now)
        follow_up: tuple[RunEvent, ...] = ()
        # A delayed run starts queued with its ``run_at`` and no delivery request: workers claim it once it
        # is due, and maintenance requests its delivery then (``delayed_delivery_at``), so no wakeup goes
        # out before a consumer could run it.
        if not spec.queue.is_bounded and spec.run_at is None:
            if created.occurred_at is now:  # built from validated parts (see _created_event)
                delivery = build_validated(
                    DeliveryIntent,
                    {
                        "environment": self._environment,
                        "run_id": spec.run_id,
                        "queue": spec.queue.name,
                        "requested_at": now,
                        "available_at": now,
                    },
                )
                requested = build_validated(
                    RunDeliveryRequestedEvent,
                    {
                        "run_id": spec.run_id,
                        "environment": self._environment,
                        "occurred_at": now,
                        "actor": spec.actor,
                        "delivery": delivery,
                    },
                )
            else:
                requested = RunDeliveryRequestedEvent(
                    run_id=spec.run_id,
                    environment=self._environment,
                    occurred_at=now,
                    actor=spec.actor,
                    delivery=DeliveryIntent(
                        environment=self._environment,
                        run_id=spec.run_id,
                        queue=spec.queue.name,
                        requested_at=now,
                        available_at=now,
                    ),
                )
            follow_up = (requested,)
        return created, follow_up

    async def create_triggered(
        self, spec: _CreateInput, *, now: datetime | None = None, publish: bool = True
    ) -> TriggerRunResult:
        """Persist a prepared trigger: ``run.created`` (+ ``run.delivery_requested`` on unbounded queues).

        ``now`` is the creation time when the caller already read the clock (a maintenance pass).
        ``publish=False`` leaves the outbox rows to the caller's own outbox phase even under eager
        dispatch (a tick publishes and counts them with the rest)."""
        if now is None:
            now = self.now()
        created, follow_up = self._creation_events(spec, now)
        hint = spec.queue.name if self._wake_hints is not None else None
        try:
            result = await self._store.create_run(CreateRunPlan(created, follow_up, spec.generated_run_id, hint))
        except StorageLimitError as error:
            raise _run_too_large(error, spec) from None
        if result.created:
            if self._observers:
                await self.observe(result.observations)
            self.wake(spec.queue.name, hinted=result.hinted)
            if result.outbox and publish and self._dispatch is TriggerDispatchMode.EAGER:
                # Eager dispatch publishes exactly the rows this trigger created; tick() owns the rest.
                try:
                    await self.publish_outbox([message.id for message in result.outbox])
                except RunlaneError as error:
                    raise _created_but_unpublished(error, result.run) from error
        return TriggerRunResult(result.run, result.outcome)

    # -- public: trigger and run_now -------------------------------------------------------------

    async def trigger(
        self,
        task: TaskDefinition | str,
        payload: Any = None,
        *,
        actor: Actor | None = None,
        concurrency_key: str | None = None,
        idempotency_key: str | None = None,
        idempotency_key_ttl: Duration | str | None = None,
        meta: Mapping[str, Any] | None = None,
        queue: QueueDefinition | str | None = None,
        run_id: str | None = None,
        singleton_key: str | None = None,
        trace_carrier: Mapping[str, str] | None = None,
        run_at: datetime | None = None,
        delay: Duration | None = None,
    ) -> TriggerRunResult:
        """Validate ``payload`` and persist a new run (or return the idempotency owner's run).

        ``run_at`` (an aware datetime) or ``delay`` (a duration) makes the run start no sooner than that;
        until then it is ``queued`` with its ``run_at`` set, holding its keys like any active run."""
        self._check_open()
        spec = self.prepare_create(
            task,
            payload,
            actor=actor,
            concurrency_key=concurrency_key,
            idempotency_key=idempotency_key,
            idempotency_key_ttl=idempotency_key_ttl,
            meta=meta,
            queue=queue,
            run_id=run_id,
            singleton_key=singleton_key,
            trace_carrier=trace_carrier,
            run_at=run_at,
            delay=delay,
        )
        await self._ready()
        return await self.create_triggered(spec)

    async def run_now(
        self,
        task: TaskDefinition | str,
        payload: Any = None,
        *,
        actor: Actor | None = None,
        concurrency_key: str | None = None,
        idempotency_key: str | None = None,
        idempotency_key_ttl: Duration | str | None = None,
        meta: Mapping[str, Any] | None = None,
        queue: QueueDefinition | str | None = None,
        run_id: str | None = None,
        singleton_key: str | None = None,
        trace_carrier: Mapping[str, str] | None = None,
        lease_duration: Duration | None = None,
        heartbeat_interval: Duration | None = None,
        max_attempt_duration: Duration | None = None,
        signal: CancellationSignal | None = None,
        worker_id: str | None = None,
    ) -> RunRecord:
        """Create a run with its lease in one commit and execute exactly one attempt in this process."""
        self._check_open()
        options = self.execution_options(lease_duration, heartbeat_interval, max_attempt_duration, signal, worker_id)
        spec = self.prepare_create(
            task,
            payload,
            actor=actor,
            concurrency_key=concurrency_key,
            idempotency_key=idempotency_key,
            idempotency_key_ttl=idempotency_key_ttl,
            meta=meta,
            queue=queue,
            run_id=run_id,
            singleton_key=singleton_key,
            trace_carrier=trace_carrier,
        )
        await self._ready()
        now = self.now()
        created = self._created_event(spec, now)
        worker_actor = Actor(type=ActorType.WORKER, id=options.worker_id)
        deadline_ms = options.max_attempt_ms if options.max_attempt_ms is not None else spec.definition.max_attempt_duration_ms
        lease = RunLease(
            worker_id=options.worker_id,
            token=random_uuid4_hex(),
            claimed_at=now,
            expires_at=later(now, options.lease_ms),
        )
        follow_up: tuple[RunEvent, ...] = (
            RunLeaseClaimedEvent(
                run_id=spec.run_id,
                environment=self._environment,
                occurred_at=now,
                actor=worker_actor,
                lease=lease,
                attempt_deadline_at=None if deadline_ms is None else later(now, deadline_ms),
            ),
            RunStartedEvent(run_id=spec.run_id, environment=self._environment, occurred_at=now, actor=worker_actor, attempt=1),
        )
        with self.registry.claiming():  # closing the runtime waits for the attempt this starts
            try:
                result = await self._store.create_run(CreateRunPlan(created, follow_up))
            except StorageLimitError as error:
                raise _run_too_large(error, spec) from None
            if not result.created:
                return result.run
            if self._observers:
                await self.observe(result.observations)
            attempt = await execute_claimed_run(self, result.run, spec.definition, options)
            if attempt.abandoned:
                raise attempt.conflict or RunlaneError(
                    ErrorCode.STORAGE_CONFLICT, "The inline attempt lost its lease; its outcome was abandoned."
                )
            assert attempt.run is not None
            return attempt.run

    # -- public: execution -----------------------------------------------------------------------

    def execution_options(
        self,
        lease_duration: Duration | None,
        heartbeat_interval: Duration | None,
        max_attempt_duration: Duration | None,
        signal: CancellationSignal | None,
        worker_id: str | None,
    ) -> ExecutionOptions:
        return resolve_execution_options(
            lease_duration,
            heartbeat_interval,
            max_attempt_duration,
            signal,
            worker_id,
            default_worker_id=self._worker_id,
        )

    async def execute_next(
        self,
        *,
        queues: Sequence[QueueDefinition | str] | None = None,
        lease_duration: Duration | None = None,
        heartbeat_interval: Duration | None = None,
        max_attempt_duration: Duration | None = None,
        signal: CancellationSignal | None = None,
        worker_id: str | None = None,
    ) -> RunRecord | None:
        """Claim one due run from ``queues`` (default: all) and execute one attempt; ``None`` when there
        was nothing to execute, the claim was lost, or the attempt was abandoned."""
        self._check_open()
        names = self.resolve_queues(queues)
        options = self.execution_options(lease_duration, heartbeat_interval, max_attempt_duration, signal, worker_id)
        if options.signal is not None and options.signal.aborted:
            return None
        await self._ready()
        with self.registry.claiming():  # closing the runtime waits for what this claims
            run, _ = await self.execute_one(names, options)
        return run

    async def execute_one(
        self,
        queues: Sequence[str],
        options: ExecutionOptions,
        pool: CandidatePool | None = None,
        *,
        unreadable_as_lost: bool = False,
    ) -> tuple[RunRecord | None, str]:
        """One scan-claim-execute step.

        Returns the run and ``"executed"``; or ``None`` with ``"idle"`` (no due work), ``"blocked"``
        (due work exists but its bounded-queue capacity is full) or ``"lost"`` (due work existed but
        this caller did not execute a run: a lost claim race or an abandoned attempt). ``pool`` is a
        candidate pool shared by the slots of one worker, so one scan feeds several claims.

        A candidate whose stored run cannot be read is set aside (later scans of this runtime pass over
        it) and its ``invariant_violation`` raised, or, with ``unreadable_as_lost`` (a worker, which
        must keep serving the other runs), reported as ``"lost"``.
        """
        if self._exclusive_claims and not any(name in self._store.queue_limits for name in queues):
            return await self._claim_next_and_execute(queues, options, unreadable_as_lost)
        if pool is None:
            pool = CandidatePool(_SCAN_HEADROOM)
        claiming = self._claiming
        set_aside = self._store.set_aside_runs  # scanned before a run was set aside, a pool may still hold it
        generation = self.work_signal.generation
        scanned = False
        blocked = lost = False
        for _ in range(_MAX_CLAIM_TRIES):
            run_id = pool.take(claiming, set_aside)
            if run_id is None:
                if scanned:
                    break
                scanned = True
                found = await pool.refill(self._store, queues, self.now(), claiming, generation)
                if found is None:
                    break  # no due work at all
                run_id = pool.take(claiming, set_aside)
                if run_id is None:
                    lost = True  # every candidate is being claimed by another caller in this process
                    await asyncio.sleep(0)
                    break
            run, status = await self._claim_and_execute(run_id, options, unreadable_as_lost)
            if status == "executed":
                return run, status
            if status == "abandoned":
                return None, "lost"
            if status == "blocked":
                blocked = True
            else:
                lost = True
        if blocked:
            return None, "blocked"
        if lost:
            return None, "lost"
        return None, "idle"

    async def _claim_and_execute(
        self, run_id: str, options: ExecutionOptions, unreadable_as_lost: bool
    ) -> tuple[RunRecord | None, str]:
        claiming = self._claiming
        claiming.add(run_id)
        try:
            deadline_ms = options.max_attempt_ms
            if deadline_ms is None and self._any_task_deadline:
                try:
                    known = await self._store.get_run(run_id)
                except RunlaneError as error:
                    if error.code is not ErrorCode.INVARIANT_VIOLATION:
                        raise
                    claim = ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST, error=error)
                    return await self._execute_claim(claim, options, unreadable_as_lost)
                if known is None:
                    claim = ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND)
                    return await self._execute_claim(claim, options, unreadable_as_lost)
                deadline_ms = self._task_deadline_ms(known)
            request = ClaimRequest.to_start(run_id, options.worker_id, options.lease_ms, deadline_ms)
            claim = await self.loop_state().claims.submit(request)
        finally:
            claiming.discard(run_id)
        return await self._execute_claim(claim, options, unreadable_as_lost)

    async def _claim_next(self, requests: list[NextClaimRequest]) -> list[ClaimResult | None]:
        """The flush of the per-loop ``next_claims`` batcher: the slots asking for work at once share
        one exclusive scan-and-claim transaction."""
        return await self._store.claim_next(requests, self.now(), self._task_deadline_ms)

    def _task_deadline_ms(self, run: RunRecord) -> int | None:
        """The attempt budget of the run's task (``max_attempt_duration``), if it has one."""
        definition = self._tasks_by_id.get(run.task_id)
        return None if definition is None else definition.max_attempt_duration_ms

    async def _claim_next_and_execute(
        self, queues: Sequence[str], options: ExecutionOptions, unreadable_as_lost: bool
    ) -> tuple[RunRecord | None, str]:
        """``execute_one`` over a driver with exclusive candidates: scan and claim in one transaction
        that other processes' scans skip, so workers of several processes never race for one run."""
        request = NextClaimRequest(
            tuple(queues), options.worker_id, options.lease_ms, options.max_attempt_ms, options.confirm_idle
        )
        claim = await self.loop_state().next_claims.submit(request)
        if claim is None:
            return None, "idle"
        return await self._execute_claim(claim, options, unreadable_as_lost)

    async def _execute_claim(
        self, claim: ClaimResult, options: ExecutionOptions, unreadable_as_lost: bool = False
    ) -> tuple[RunRecord | None, str]:
        run = claim.run
        if run is None:
            error = claim.error
            if error is not None:
                if error.code is not ErrorCode.INVARIANT_VIOLATION:
                    raise error
                self._set_aside_unreadable(claim.run_id, error)
                if unreadable_as_lost:
                    return None, "lost"
                raise error
            if claim.reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST:
                return None, "blocked"  # the bounded-queue partition is full
            if claim.reason in _UNCLAIMABLE_REASONS:
                self._note_unclaimable(claim)
            return None, "lost"
        if self._unclaimable:
            self._unclaimable.pop(run.id, None)
        if self._observers:
            await self.observe(claim.observations)
        result = await execute_claimed_run(self, run, self._tasks_by_id.get(run.task_id), options)
        if result.abandoned:
            return None, "abandoned"
        return result.run, "executed"

    def _set_aside_unreadable(self, run_id: str, error: RunlaneError) -> None:
        """Pass over a run whose stored record cannot be read, for the life of this runtime: one corrupt
        record must not stop every worker of the lane (each would claim it first, forever), nor hold a
        place in every maintenance pass."""
        set_aside = self._store.set_aside_runs
        if run_id in set_aside:
            return
        set_aside.add(run_id)
        _worker_log.error(
            "Run %s cannot be run or recovered: its stored record %s is unreadable (%s: %s). It is set aside: "
            "the workers and tick() of this process pass over it until they restart, and the other runs go "
            "on. Repair or delete the run's records, then restart the workers to run it.",
            run_id, describe_record_key(run_key(self._env_key, run_id)), error.code.value, error.message,
            extra={"run_id": run_id, "error_code": error.code.value},
        )  # fmt: skip

    def _pass_over_failed(self, run_id: str, error: RunlaneError) -> None:
        """A run a maintenance pass could not process: when its own record is corrupt (the error names
        it), it is set aside (and logged), so the pass is not silent about it and later passes do not
        meet it again; any other failure is tried again next pass."""
        if error.code is not ErrorCode.INVARIANT_VIOLATION:
            return
        meta = error.meta
        if meta.get("run_id") == run_id or meta.get("key") == run_key(self._env_key, run_id).encoded:
            self._set_aside_unreadable(run_id, error)

    def _note_unclaimable(self, claim: ClaimResult) -> None:
        """Count a claim that found the run behind a runnable candidate missing or finished; a candidate
        that keeps coming back so is set aside, since its index row is stale (else workers spin on it)."""
        run_id = claim.run_id
        counts = self._unclaimable
        seen = counts.pop(run_id, 0) + 1
        if seen < _UNCLAIMABLE_SET_ASIDE:
            counts[run_id] = seen  # re-inserted: the dict keeps the most recent candidates last
            while len(counts) > _UNCLAIMABLE_TRACKED:
                del counts[next(iter(counts))]
            return
        set_aside = self._store.set_aside_runs
        if run_id in set_aside:
            return
        set_aside.add(run_id)
        state = "missing" if claim.reason is ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND else "finished"
        _worker_log.warning(
            "Run %s is listed as due in the runnable index, but %d claims found the run %s: its index row may "
            "be corrupt. It is set aside: workers of this process pass over it until they restart. Check "
            "the lane's storage for a stale runnable index row of this run.",
            run_id, seen, state,
            extra={"run_id": run_id, "reason": claim.reason.value if claim.reason is not None else None},
        )  # fmt: skip

    def worker(
        self,
        *,
        mode: WorkerMode | WorkerModeName = WorkerMode.POLL,
        queues: Sequence[QueueDefinition | str] | None = None,
        concurrency: int = 1,
        empty_poll_delay: Duration | None = None,
        max_runs: int | None = None,
        lease_duration: Duration | None = None,
        heartbeat_interval: Duration | None = None,
        max_attempt_duration: Duration | None = None,
        on_run_executed: Callable[[RunRecord], Any] | None = None,
        signal: CancellationSignal | None = None,
        worker_id: str | None = None,
    ) -> WorkerHandle:
        """Start a poll or drain worker on the running event loop and return its handle."""
        from .worker import WorkerHandle

        self._check_open()
        try:
            worker_mode = WorkerMode(mode)
        except ValueError:
            raise _invalid(f"Unknown worker mode {mode!r}; use WorkerMode.POLL or WorkerMode.DRAIN.", field="mode") from None
        names = self.resolve_queues(queues)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise _invalid(f"concurrency must be a positive whole number, got {concurrency!r}.", field="concurrency")
        if concurrency > MAX_WORKER_CONCURRENCY:
            raise _invalid(
                f"concurrency must be at most {MAX_WORKER_CONCURRENCY:,} slots per worker, got {concurrency:,}; "
                "run more worker processes for more at once.",
                field="concurrency",
                max=MAX_WORKER_CONCURRENCY,
            )
        if empty_poll_delay is not None and worker_mode is WorkerMode.DRAIN:
            raise _invalid("empty_poll_delay applies only to poll workers; drain workers never sleep.", field="empty_poll_delay")
        delay_ms = duration_ms(empty_poll_delay if empty_poll_delay is not None else _DEFAULT_EMPTY_POLL_DELAY, "empty_poll_delay")
        if max_runs is not None:
            if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
                raise _invalid(f"max_runs must be a positive whole number, got {max_runs!r}.", field="max_runs")
            if worker_mode is not WorkerMode.DRAIN:
                raise _invalid("max_runs applies only to drain workers.", field="max_runs")
        if on_run_executed is not None and not callable(on_run_executed):
            raise _invalid(f"on_run_executed must be a function, got {on_run_executed!r}.", field="on_run_executed")
        options = self.execution_options(lease_duration, heartbeat_interval, max_attempt_duration, signal, worker_id)
        # A worker rides out storage outages (its attempts retry heartbeats and outcome writes while
        # their lease holds); a poll worker looks again soon anyway, so "idle" needs no full rescan.
        options = dataclasses.replace(
            options,
            ride_out_outages=True,
            confirm_idle=worker_mode is not WorkerMode.POLL,
            outage_limit_s=DRAIN_OUTAGE_LIMIT_S if worker_mode is WorkerMode.DRAIN else None,
        )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise _invalid(
                "runlane.worker() starts tasks on the running event loop; call it from async code, "
                "or use runlane.sync.worker() from synchronous code."
            ) from None
        return WorkerHandle(
            self,
            mode=worker_mode,
            queues=names,
            concurrency=concurrency,
            empty_poll_delay=delay_ms / 1000,
            max_runs=max_runs,
            options=options,
            on_run_executed=on_run_executed,
        )

    async def execute_delivery(
        self,
        message: DeliveryMessage | Mapping[str, Any],
        *,
        lease_duration: Duration | None = None,
        heartbeat_interval: Duration | None = None,
        max_attempt_duration: Duration | None = None,
        signal: CancellationSignal | None = None,
        worker_id: str | None = None,
    ) -> ExecuteDeliveryResult:
        """Execute exactly the run a transport delivered, or report why it is ignored (ack-safe)."""
        self._check_open()
        if not isinstance(message, DeliveryMessage):
            try:
                message = DeliveryMessage.model_validate(message)
            except ValidationError as error:
                # One clause per problem, naming the field and the rule: pydantic's own text is several
                # lines quoting each input, and a trace carrier may hold a credential.
                problems = [
                    f"{'.'.join(['message', *(str(part) for part in item['loc'])])}: {pydantic_message(item)}"
                    for item in error.errors(include_url=False, include_input=False)
                ]
                shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                raise _invalid(f"Malformed delivery message: {shown}.", field="message") from None
        if environment_key(message.environment) != self._env_key:
            raise _invalid(
                f"The delivery message is for environment {message.environment.name!r}, "
                f"but this runtime serves {self._environment.name!r}: give each environment SQS queues of its "
                "own (a consumer cannot run another environment's wakeups, and they end up dead-lettered).",
                field="message.environment",
            )
        options = self.execution_options(lease_duration, heartbeat_interval, max_attempt_duration, signal, worker_id)
        if options.signal is not None and options.signal.aborted:
            raise RunlaneError(
                ErrorCode.OPERATION_CANCELLED,
                "The delivery was cancelled before its run was claimed; do not acknowledge the message.",
                meta={"run_id": message.run_id},
            )
        with self.registry.claiming():  # closing the runtime waits for what this reads, claims and runs
            return await self._execute_delivery(message, options)

    async def _execute_delivery(self, message: DeliveryMessage, options: ExecutionOptions) -> ExecuteDeliveryResult:
        await self._ready()
        run = await self._store.get_run(message.run_id)
        if run is None:
            return ExecuteDeliveryResult(ExecuteDeliveryStatus.IGNORED, ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND)
        if run.queue != message.queue:
            return ExecuteDeliveryResult(ExecuteDeliveryStatus.IGNORED, ExecuteDeliveryIgnoredReason.WRONG_QUEUE, run)
        if run.status in _TERMINAL:
            return ExecuteDeliveryResult(ExecuteDeliveryStatus.IGNORED, ExecuteDeliveryIgnoredReason.TERMINAL, run)
        definition = self._tasks_by_id.get(run.task_id)
        queue_registered = run.queue in self._queues._items
        deadline_ms = options.max_attempt_ms
        if deadline_ms is None and definition is not None:
            deadline_ms = definition.max_attempt_duration_ms
        claim = await self.loop_state().claims.submit(
            ClaimRequest.to_start(run.id, options.worker_id, options.lease_ms, deadline_ms, queue=message.queue)
        )
        if claim.run is None:
            if claim.error is not None:
                raise claim.error
            return ExecuteDeliveryResult(
                ExecuteDeliveryStatus.IGNORED, claim.reason or ExecuteDeliveryIgnoredReason.CLAIM_LOST, run
            )
        if self._observers:
            await self.observe(claim.observations)
        if not queue_registered:
            failure = RunFailure(
                code=ErrorCode.CONFIGURATION_INVALID,
                message="The run's queue is not registered in this runtime.",
                retryable=False,
                meta={"queue": claim.run.queue},
            )
            result = await _fail_claimed(self, claim.run, failure)
        else:
            result = await execute_claimed_run(self, claim.run, definition, options)
        if result.abandoned:
            return ExecuteDeliveryResult(ExecuteDeliveryStatus.IGNORED, ExecuteDeliveryIgnoredReason.ABANDONED)
        return ExecuteDeliveryResult(ExecuteDeliveryStatus.EXECUTED, None, result.run)

    # -- public: maintenance ---------------------------------------------------------------------

    async def tick(
        self,
        *,
        schedule_materialization_limit: int | None = None,
        delivery_request_limit: int | None = None,
        cancellation_finalization_limit: int | None = None,
        timeout_finalization_limit: int | None = None,
        outbox_claim_limit: int | None = None,
        dispatch_reservation_limit: int | None = None,
    ) -> TickResult:
        """One bounded maintenance pass. Never runs task code.

        Reads the runtime clock once, then runs schedule materialization, cancellation finalization,
        timeout finalization, bounded-queue dispatch, delivery recovery and (on transport lanes)
        outbox publishing in that order; publishing reads the clock again, so the rows the earlier
        phases wrote go out in the same pass. Materialization is durable per occurrence, not across
        the schedules: when one schedule fails (a corrupt stored occurrence, a payload that no longer
        validates), the occurrences materialized before it stay, and the pass stops with its error, so
        neither the schedules after it nor the later phases run in that call; a pass after the failure
        is fixed (or the schedule disabled) does the rest.

        In the later phases, a run whose record is corrupt is passed over (and logged), and a phase that
        fails with another error that is not retryable does not stop the phases after it: one bad record
        must not halt recovery, finalization and publishing for the whole lane. Once every phase has
        run, the first such error is raised. A retryable error (storage unavailable) is raised at once:
        the later phases would meet the same outage.
        """
        self._check_open()
        schedule_limit = _limit(
            schedule_materialization_limit, "schedule_materialization_limit", _MAINTENANCE.schedule_materialization_limit
        )
        delivery_limit = _limit(delivery_request_limit, "delivery_request_limit", _MAINTENANCE.delivery_request_limit)
        cancel_limit = _limit(
            cancellation_finalization_limit, "cancellation_finalization_limit", _MAINTENANCE.cancellation_finalization_limit
        )
        timeout_limit = _limit(timeout_finalization_limit, "timeout_finalization_limit", _MAINTENANCE.timeout_finalization_limit)
        outbox_limit = _limit(outbox_claim_limit, "outbox_claim_limit", _MAINTENANCE.outbox_claim_limit)
        dispatch_limit = _limit(
            dispatch_reservation_limit, "dispatch_reservation_limit", _MAINTENANCE.dispatch_reservation_limit
        )
        await self._ready()
        now = self.now()
        failure: RunlaneError | None = None

        async def phase(run: Awaitable[T], failed: T) -> T:
            """The phase's counts; ``failed`` when it raised an error that is not retryable (kept)."""
            nonlocal failure
            try:
                return await run
            except RunlaneError as error:
                if error.retryable:
                    raise
                if failure is None:
                    failure = error
                return failed

        materialized = await self._materialize_schedules(now, schedule_limit)  # a failure ends the pass
        cancelled = await phase(self._finalize_cancellations(now, cancel_limit), 0)
        timed_out = await phase(self._finalize_timeouts(now, timeout_limit), 0)
        reserved = await phase(self._dispatch_bounded(now, dispatch_limit), 0)
        delivered = await phase(self._recover_deliveries(now, delivery_limit), 0)
        published = failed = dead = 0
        if self._store.outbox:
            # The clock is read again: the rows this pass wrote (dispatch reservations, recovered
            # deliveries) are stamped by their commits, after ``now``, and are due in this pass.
            published, failed, dead = await phase(self._flush_outbox(self.now(), outbox_limit), (0, 0, 0))
        if failure is not None:
            raise failure
        return TickResult(
            materialized=materialized,
            delivery_requested=delivered,
            cancellations_finalized=cancelled,
            timeouts_finalized=timed_out,
            dispatch_reserved=reserved,
            outbox_published=published,
            outbox_failed=failed,
            outbox_dead_lettered=dead,
        )

    async def _dispatch_bounded(self, now: datetime, limit: int) -> int:
        """Reserve bounded-queue capacity for due queued runs (and runs whose reservation expired).

        Each reservation appends ``run.delivery_requested`` with ``dispatch_expires_at`` in the same
        commit that takes the capacity slot; a full partition skips its runs until a slot frees.

        The pass's ``limit`` is shared by the bounded queues: each is first offered an equal share (in
        turns starting with a different queue each pass, when the limit is smaller than their number),
        and what some leave unused goes to those that took all of theirs. A queue with a backlog longer
        than the limit would otherwise take the whole of every pass, and the runs of the queues after it
        would never be reserved: on a transport lane they get no wakeup without a reservation.
        """
        bounded = [queue for queue in self._queues.values() if queue.concurrency_limit is not None]
        if not bounded:
            return 0
        turn = self._dispatch_turn % len(bounded)
        self._dispatch_turn = turn + 1
        waiting = bounded[turn:] + bounded[:turn]
        count = 0
        while waiting and count < limit:
            share = max(1, (limit - count) // len(waiting))
            took_all: list[QueueDefinition] = []
            for queue in waiting:
                wanted = min(share, limit - count)
                if wanted < 1:
                    break
                reserved = await self._dispatch_queue(queue, now, wanted)
                count += reserved
                if reserved == wanted:
                    took_all.append(queue)  # it may have more
            waiting = took_all
        return count

    async def _dispatch_queue(self, queue: QueueDefinition, now: datetime, limit: int) -> int:
        """Reserve capacity for at most ``limit`` due runs of bounded ``queue``; returns how many."""
        rows = await self._store.open_candidates(StorageIndexName.RUNS_NEEDING_DISPATCH, queue.name, now, limit)
        if not rows and self._store.outbox:
            # Nothing to reserve where this release indexes dispatch candidates; on a transport lane,
            # queued runs an earlier release wrote while the queue had no limit are indexed only as
            # runnable, and their wakeups went out then (a consumer refuses one while the queue is
            # full): reserved from there, they get a new wakeup, as a run triggered now would.
            rows = await self._store.open_candidates(StorageIndexName.RUNS_RUNNABLE, queue.name, now, limit)
        if not rows:
            return 0
        timeout_ms = _dispatch_timeout_ms(queue)
        return await self._reserve([ReserveRequest(run_id, timeout_ms) for _, run_id in rows])

    # -- outbox publishing -----------------------------------------------------------------------

    async def _flush_outbox(self, now: datetime, limit: int) -> tuple[int, int, int]:
        """Claim and publish due outbox rows, at most ``limit`` of them."""
        published = failed = dead = 0
        ids = await self._store.list_due_outbox(now, limit)
        if ids:
            published, failed, dead = await self.publish_outbox(ids)
        return published, failed, dead

    async def publish_outbox(self, ids: Sequence[str]) -> tuple[int, int, int]:
        """Claim the due rows among ``ids``, publish them through the lane's transport and record each
        outcome by index. Returns ``(published, failed, dead_lettered)``.

        Each queue's rows are published by one call. An operation-level ``transport_unavailable`` /
        ``transport_publish_failed`` marks that queue's rows failed (or dead-lettered when not
        retryable); any other error, including a malformed publish result, leaves that queue's rows
        claimed until their claim expires and is raised once the other queues' outcomes are recorded.
        """
        transport = self._lane.delivery.transport
        if transport is None or not ids:
            return 0, 0, 0
        token = random_uuid4_hex()
        claimed = await self._store.claim_outbox(
            ids, claim_token=token, claim_ms=_OUTBOX_CLAIM_MS, worker_id=self._worker_id
        )
        if not claimed:
            return 0, 0, 0
        # One publish call per queue: a queue whose binding the transport refuses (a queue name that
        # does not resolve) holds back its own wakeups only, and its error is raised once the other
        # queues' outcomes are recorded; its rows stay claimed until the claim expires.
        by_queue: dict[str, list[OutboxMessage]] = {}
        for message in claimed:
            by_queue.setdefault(message.queue, []).append(message)
        answers = await asyncio.gather(
            *(self._publish_group(transport, token, group) for group in by_queue.values()), return_exceptions=True
        )
        marks: list[OutboxMark] = []
        refused: BaseException | None = None
        for queue, answer in zip(by_queue, answers):
            if isinstance(answer, BaseException):
                refused = refused or _refused_for_queue(answer, queue)
            else:
                marks.extend(answer)
        try:
            if marks:
                await self._store.mark_outbox(token, marks)
        except RunlaneError as error:
            if not is_storage_conflict(error, StorageConflictKind.OUTBOX_CLAIM):
                raise
            # Some rows were reclaimed by another publisher after this claim expired: record the rest
            # one by one; the reclaimed rows belong to their new claim.
            kept = []
            for mark in marks:
                try:
                    await self._store.mark_outbox(token, [mark])
                except RunlaneError as single:
                    if not is_storage_conflict(single, StorageConflictKind.OUTBOX_CLAIM):
                        raise
                    continue
                kept.append(mark)
            marks = kept
        published = sum(1 for mark in marks if mark.status is OutboxMessageStatus.PUBLISHED)
        failed = sum(1 for mark in marks if mark.status is OutboxMessageStatus.FAILED)
        dead = sum(1 for mark in marks if mark.status is OutboxMessageStatus.DEAD_LETTERED)
        if failed:
            self._report_failed_publishes(claimed, marks)
        if dead:
            runs = {message.id: message for message in claimed}
            for mark in marks:
                if mark.status is OutboxMessageStatus.DEAD_LETTERED and mark.failure is not None:
                    message = runs[mark.outbox_message_id]
                    bounded = self._queues.get(message.queue)
                    if bounded is not None and bounded.concurrency_limit is not None:
                        # Its reservation expires and tick() reserves it again, with a new wakeup.
                        then = "tick() reserves it again, with a new wakeup, once its reservation expires"
                    else:
                        then = "the run stays queued without a wakeup: fix the cause, then cancel and rerun it"
                    _transport_log.warning(
                        "The wakeup of run %s (queue %s) was dead-lettered after %d attempt(s): %s (%s); %s.",
                        message.run_id, message.queue, message.attempts + 1, mark.failure.code.value,
                        mark.failure.message, then,
                        extra={"run_id": message.run_id, "queue": message.queue, "error_code": mark.failure.code.value},
                    )  # fmt: skip
        if refused is not None:
            raise refused  # once the other queues' outcomes are recorded and their dead letters reported
        return published, failed, dead

    def _report_failed_publishes(self, claimed: Sequence[OutboxMessage], marks: Sequence[OutboxMark]) -> None:
        """A ``runlane.transport`` warning per queue and failure for the wakeups left to a retry, at most
        one a minute: an outage is otherwise visible only as ``tick()``'s ``outbox_failed`` count."""
        rows = {message.id: message for message in claimed}
        groups: dict[tuple[str, str, str], list[tuple[OutboxMessage, OutboxMark]]] = {}
        for mark in marks:
            if mark.status is OutboxMessageStatus.FAILED and mark.failure is not None:
                message = rows[mark.outbox_message_id]
                key = (message.queue, mark.failure.code.value, mark.failure.message)
                groups.setdefault(key, []).append((message, mark))
        now = self.now()
        for (queue, code, reason), members in groups.items():
            # At most one report per queue and failure code a minute: during an outage every trigger of an
            # eager lane and every tick fails to publish, and a line for each would bury everything else.
            logged_at, unreported = self._publish_failures.get((queue, code), (None, 0))
            if logged_at is not None and (now - logged_at).total_seconds() < _PUBLISH_REPORT_INTERVAL_S:
                self._publish_failures[(queue, code)] = (logged_at, unreported + len(members))
                continue
            self._publish_failures[(queue, code)] = (now, 0)
            since = f" (and {unreported} more since the last report)" if unreported else ""
            soonest = min((mark.next_available_at for _, mark in members if mark.next_available_at), default=None)
            retry = f" from {soonest.isoformat().replace('+00:00', 'Z')}" if soonest is not None else ""
            most = max(message.attempts for message, _ in members) + 1
            _transport_log.warning(
                "%d wakeup(s) of queue %s not published (attempt %d)%s: %s (%s). The runs are queued and safe; "
                "tick() publishes them again%s, with backoff up to 5 minutes, until the transport takes them.",
                len(members), queue, most, since, code, reason, retry,
                extra={"queue": queue, "error_code": code, "run_ids": [message.run_id for message, _ in members]},
            )  # fmt: skip

    async def _publish_group(self, transport: Any, token: str, group: Sequence[OutboxMessage]) -> list[OutboxMark]:
        """Publish the claimed rows of one queue; an operation-level ``transport_unavailable`` /
        ``transport_publish_failed`` marks them all failed, any other error is raised."""
        command = PublishWakeupsCommand(WakeupPublishAttempt(message.id, token, message.message) for message in group)
        try:
            raw = await transport.publish_wakeups(command)
        except RunlaneError as error:
            if error.code not in (ErrorCode.TRANSPORT_UNAVAILABLE, ErrorCode.TRANSPORT_PUBLISH_FAILED):
                raise
            failure = OutboxFailureRecord(
                code=error.code,
                message=error.message,
                retryable=error.code is ErrorCode.TRANSPORT_UNAVAILABLE or bool(error.retryable),
                failed_at=self.now(),
                meta=_json_meta(error.meta),
            )
            return [self._failure_mark(message, failure) for message in group]
        result = parse_publish_wakeups_result(command, raw)
        marks = []
        for message, outcome in zip(group, result.outcomes):
            if outcome.type is WakeupPublishOutcomeType.PUBLISHED:
                marks.append(
                    OutboxMark(
                        message.id,
                        OutboxMessageStatus.PUBLISHED,
                        published_at=outcome.published_at,
                        provider_message_id=outcome.provider_message_id,
                    )
                )
            else:
                assert outcome.failure is not None
                marks.append(self._failure_mark(message, outcome.failure))
        return marks

    def _failure_mark(self, message: OutboxMessage, failure: OutboxFailureRecord) -> OutboxMark:
        if not failure.retryable:
            return OutboxMark(message.id, OutboxMessageStatus.DEAD_LETTERED, failure=failure)
        # 2 ** 9 s already passes the cap; the exponent is bounded so a row failing for days stays cheap.
        delay_ms = min(_OUTBOX_RETRY_BASE_MS * 2 ** min(message.attempts, 9), _OUTBOX_RETRY_MAX_MS)
        return OutboxMark(
            message.id,
            OutboxMessageStatus.FAILED,
            failure=failure,
            next_available_at=later(self.now(), delay_ms),
        )

    def _scheduled_run(
        self, item: ScheduleDefinition, definition: TaskDefinition, occurrence_id: str, run_id: str
    ) -> _CreateInput:
        """The run an occurrence of ``item`` creates: an ordinary run, whose singleton and concurrency keys
        apply and whose idempotency key does not (``stored``)."""
        return self.prepare_create(
            definition,
            item.payload,
            actor=Actor(type=ActorType.SCHEDULE, id=item.id),
            queue=item.queue,
            run_id=run_id,
            source=RunSource(type=RunSourceType.SCHEDULE, schedule_id=item.id, occurrence_id=occurrence_id),
            stored=True,
        )

    def _check_scheduled_runs_fit(self) -> None:
        """Refuse a schedule whose runs could never be stored on this lane: every maintenance pass would
        claim its fire time and fail, and stop at it. Its run is built here as a pass would build it (the
        ids and times of every fire time have one length) and measured against the room a new run must
        leave; a payload that no longer validates is left to be reported when the schedule is due."""
        now = self.now()
        for item, definition in self._schedules:
            occurrence_id = schedule_occurrence_id(self._environment, item.id, now)
            try:
                spec = self._scheduled_run(item, definition, occurrence_id, scheduled_run_id(occurrence_id))
            except RunlaneError:
                continue
            created, follow_up = self._creation_events(spec, now)
            try:
                run = project_run_events(None, 0, [created, *follow_up])
                check_room_to_run(self._store, run, len(follow_up) + 1)
            except StorageLimitError as error:
                size = len(canonical_json(spec.payload).encode())
                raise _invalid(
                    f"Schedule {item.id!r} of task {definition.id!r}: a run of it would take {error.actual:,} bytes, "
                    f"and could never be stored on this lane (max_record_bytes "
                    f"{self._store.driver.profile.limits.max_record_bytes:,}, of which {error.reserved:,} stay free "
                    f"for what a run records); its payload takes {size:,}. Keep large data elsewhere and pass a "
                    "reference (an id, a URL) in the payload.",
                    field="payload",
                    task_id=definition.id,
                    schedule_id=item.id,
                ) from None

    def _check_queue_capacity_fits(self) -> None:
        """Refuse a bounded queue whose ``concurrency_limit`` one capacity partition could never reach on
        this lane: its occupants share one record, and once it is full every further reservation or claim
        of the partition would fail, the queue stalled below its limit."""
        limits = self._store.driver.profile.limits
        for definition in self._queues.values():
            limit = definition.concurrency_limit
            if limit is None:
                continue
            room = capacity_partition_room(self._env_key, definition.name, limits)
            if limit > room:
                raise _invalid(
                    f"Queue {definition.name!r}: concurrency_limit {limit:,} is more runs than one capacity "
                    f"partition can hold on this lane (about {room:,}: the running and reserved runs of a "
                    f"partition are kept in one record of at most max_record_bytes {limits.max_record_bytes:,}). "
                    f"Set concurrency_limit to at most {room:,}, or leave the queue unbounded.",
                    queue=definition.name,
                    concurrency_limit=limit,
                )

    async def _materialize_schedules(self, now: datetime, limit: int) -> int:
        """Materialize the latest due occurrence of every enabled registered schedule (no backfill)."""
        if not self._schedules:
            return 0

        async def create_run(
            item: ScheduleDefinition, definition: TaskDefinition, occurrence: ScheduleOccurrence, run_id: str
        ) -> RunRecord:
            spec = self._scheduled_run(item, definition, occurrence.id, run_id)
            # The pass's outbox phase publishes its wakeup with the rest, and counts it.
            return (await self.create_triggered(spec, now=now, publish=False)).run

        return await self._materializer.materialize_due(
            self._schedules,
            now,
            limit=limit,
            create_run=create_run,
            get_run=self._store.get_run,
            worker_id=self._worker_id,
            claim_duration_ms=_DEFAULT_LEASE_MS,
        )

    async def _scan_and_append(
        self,
        index: StorageIndexName,
        now: datetime,
        limit: int,
        build_for: Callable[[], Callable[[RunRecord, datetime], list[RunEvent]]],
        partition: Sequence[str] = (),
        appended: Callable[[AppendResult], None] | None = None,
    ) -> int:
        """Append what ``build_for()`` builds to the runs ``index`` lists as due at ``now``, at most ``limit``
        of them; the number of runs appended to. ``appended`` is told of each of those appends."""
        count = 0
        page = self._store.driver.profile.limits.max_query_results
        seen: set[str] = set()
        set_aside = self._store.set_aside_runs
        while count < limit:
            wanted = min(page, limit - count)
            found = await self._store.query_index(
                index, partition, until=now, limit=wanted + len(seen) + len(set_aside)
            )
            run_ids = [run_id for run_id in found if run_id not in seen and run_id not in set_aside][:wanted]
            if not run_ids:
                break
            seen.update(run_ids)
            results = await self.append_many([CompletionRequest(run_id, build_for()) for run_id in run_ids])
            for run_id, result in zip(run_ids, results):
                if isinstance(result, AppendResult):
                    if result.events:
                        count += 1
                        if appended is not None:
                            appended(result)
                else:
                    self._pass_over_failed(run_id, result)
            if len(run_ids) < wanted:
                break
        return count

    async def _finalize_cancellations(self, now: datetime, limit: int) -> int:
        def build_for() -> Callable[[RunRecord, datetime], list[RunEvent]]:
            def build(run: RunRecord, at: datetime) -> list[RunEvent]:
                available = get_run_cancellation_finalization_available_at(run)
                if available is None or available > at or available > now:
                    return []
                if self._store.lease_held_here(run):
                    return []  # alive in this process, which stopped it: its clock stepped past the lease
                return [
                    RunCancelledEvent(
                        run_id=run.id,
                        environment=run.environment,
                        occurred_at=at,
                        actor=_SYSTEM_ACTOR,
                        reason="cancellation_lease_expired",
                    )
                ]

            return build

        return await self._scan_and_append(StorageIndexName.RUNS_NEEDING_CANCELLATION_FINALIZATION, now, limit, build_for)

    async def _finalize_timeouts(self, now: datetime, limit: int) -> int:
        tasks = self._tasks_by_id

        def build_for() -> Callable[[RunRecord, datetime], list[RunEvent]]:
            def build(run: RunRecord, at: datetime) -> list[RunEvent]:
                available = get_run_attempt_timeout_finalization_available_at(run)
                if available is None or available > at or available > now:
                    return []
                if self._store.lease_held_here(run):
                    # Alive in this process, past its deadline only because the clock stepped: the attempt
                    # reaches its deadline at the heartbeat this check asks for, and records the timeout.
                    return []
                failure = timed_out_failure()
                definition = tasks.get(run.task_id)
                return failure_outcome_events(
                    run, at, failure, None if definition is None else definition.retry, _SYSTEM_ACTOR, allow_retry=True
                )

            return build

        # The worker that ran such an attempt is gone (or its handler ignores the deadline): the log says
        # the attempt failed, as that worker's would have.
        return await self._scan_and_append(
            StorageIndexName.RUNS_NEEDING_TIMEOUT_FINALIZATION,
            now,
            limit,
            build_for,
            appended=lambda result: log_timed_out_attempt(result.run),
        )

    async def _resume_overdue_waiters(self, now: datetime, limit: int) -> int:
        """Resume the runs still waiting for sources that finished at least ``COMPLETION_RESUME_GRACE_MS``
        before ``now``, at most ``limit`` sources: the process that finished each source resumes its waiters
        at once, and this takes over when it died first, or gave up through a long outage. The number of
        runs resumed. A source whose waiters cannot be resumed for another reason than unavailable storage
        is logged and passed over by this process's later passes (a waiter's corrupt record, say)."""
        count = 0
        passed_over = self._stuck_resumes
        found = await self._store.query_index(
            StorageIndexName.RUNS_NEEDING_DELIVERY,
            (RUN_COMPLETION_WAITS_COLLECTION,),
            until=now,
            limit=limit + len(passed_over),
        )
        for source_run_id in [source for source in found if source not in passed_over][:limit]:
            try:
                count += len(await self.resume_completion_waiters(source_run_id))
                await self._store.completion_resumed(source_run_id)
            except RunlaneError as error:
                if error.retryable:
                    raise
                passed_over.add(source_run_id)
                _waiter_log.error(
                    "The runs waiting for run %s (wait_for_run), which has finished, could not all be resumed: "
                    "%s: %s. This process passes over them until it restarts.",
                    source_run_id, error.code.value, error.message,
                    extra={"run_id": source_run_id, "error_code": error.code.value},
                )  # fmt: skip
        return count

    async def _recover_deliveries(self, now: datetime, limit: int) -> int:
        bounded: dict[str, QueueDefinition] = {}  # run id -> its bounded queue

        def build_for() -> Callable[[RunRecord, datetime], list[RunEvent]]:
            def build(run: RunRecord, at: datetime) -> list[RunEvent]:
                available = get_run_delivery_recovery_available_at(run)
                if available is None and run.queue not in self._store.queue_limits:
                    available = delayed_delivery_at(run)  # a delayed trigger's run, now due
                if available is None or available > at or available > now:
                    return []
                if run.status is RunStatus.RUNNING and self._store.lease_held_here(run):
                    return []  # alive in this process: its clock stepped past the lease
                queue = self._queues.get(run.queue)
                if queue is not None and queue.concurrency_limit is not None:
                    # Written before bounded runs were dispatch candidates: wake it through a
                    # reservation, like the dispatch phase, not with a bare delivery request.
                    bounded[run.id] = queue
                    return []
                return [_delivery_event(run, at, _SYSTEM_ACTOR)]

            return build

        count = await self._resume_overdue_waiters(now, limit)
        count += await self._scan_and_append(StorageIndexName.RUNS_NEEDING_DELIVERY, now, limit - count, build_for)
        if bounded:
            count += await self._reserve(
                [ReserveRequest(run_id, _dispatch_timeout_ms(queue)) for run_id, queue in bounded.items()]
            )
        for queue in self._queues.values():
            if count >= limit:
                break
            if queue.concurrency_limit is None:
                count += await self._scan_and_append(
                    StorageIndexName.RUNS_NEEDING_DISPATCH, now, limit - count, self._unbounded_dispatch, (queue.name,)
                )
        return count

    def _unbounded_dispatch(self) -> Callable[[RunRecord, datetime], list[RunEvent]]:
        """Delivery requests for the dispatch candidates of a queue that was bounded when they were
        written and is not now (a release dropped its concurrency limit): no dispatch phase scans that
        queue any more, so without them its queued and retrying runs would wait for a reservation
        forever on a transport lane. Appending rewrites each run's index rows as an unbounded run's."""

        def build(run: RunRecord, at: datetime) -> list[RunEvent]:
            if run.queue in self._store.queue_limits:
                return []  # bounded again: the dispatch phase reserves it
            available = get_run_dispatch_available_at(run)
            if available is None or available > at:
                return []  # a reservation whose wakeup is still out, or not due yet
            if run.status is RunStatus.RUNNING and self._store.lease_held_here(run):
                return []
            return [_delivery_event(run, at, _SYSTEM_ACTOR)]

        return build

    async def _reserve(self, requests: list[ReserveRequest]) -> int:
        """Reserve capacity for ``requests``; observe and wake the queues of the runs reserved. Runs no
        longer dispatchable, in a full partition or unreadable are skipped, like the other phases."""
        results = await self._store.reserve_dispatch(requests)
        for result in results:
            if result.error is not None:
                self._pass_over_failed(result.run_id, result.error)
        reserved = [result for result in results if result.reserved]
        for result in reserved:
            if self._observers:
                await self.observe(result.observations)
        for queue in {result.run.queue for result in reserved if result.run is not None}:
            self.wake(queue)
        return len(reserved)


# Leases shorter than this are accepted (any positive duration is) but logged once per value: heartbeats
# are storage writes, and a lease of a few milliseconds can expire while one is written.
_SHORT_LEASE_MS = 1000
_short_leases_logged: set[int] = set()


def resolve_execution_options(
    lease_duration: Duration | None,
    heartbeat_interval: Duration | None,
    max_attempt_duration: Duration | None,
    signal: CancellationSignal | None,
    worker_id: str | None,
    *,
    default_worker_id: str,
) -> ExecutionOptions:
    """The execution options of ``execute_next`` / ``execute_delivery`` / ``run_now`` / ``worker``,
    validated (``configuration_invalid``); a transport consumer checks its options with it up front."""
    lease_ms = _DEFAULT_LEASE_MS if lease_duration is None else duration_ms(lease_duration, "lease_duration")
    if lease_ms < _SHORT_LEASE_MS and lease_ms not in _short_leases_logged:
        _short_leases_logged.add(lease_ms)
        _worker_log.warning(
            "lease_duration is %s: a lease shorter than %s can expire while its heartbeat is being written, and "
            "then another worker runs the run's handler again.",
            format_duration(lease_ms), format_duration(_SHORT_LEASE_MS),
        )  # fmt: skip
    if heartbeat_interval is None:
        heartbeat_ms = max(1, lease_ms // 2)
    else:
        heartbeat_ms = duration_ms(heartbeat_interval, "heartbeat_interval")
        if heartbeat_ms >= lease_ms:
            raise _invalid(
                f"heartbeat_interval ({format_duration(heartbeat_ms)}) must be shorter than lease_duration "
                f"({format_duration(lease_ms)}); otherwise the lease expires between heartbeats.",
                field="heartbeat_interval",
            )
    attempt_ms = None if max_attempt_duration is None else duration_ms(max_attempt_duration, "max_attempt_duration")
    if signal is not None and not isinstance(signal, CancellationSignal):
        raise _invalid(
            f"signal must be a CancellationSignal (CancellationController().signal), got {signal!r}.", field="signal"
        )
    owner = default_worker_id if worker_id is None else validate_id(worker_id, "worker id")
    return ExecutionOptions(
        lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, max_attempt_ms=attempt_ms, signal=signal, worker_id=owner
    )


# Runtimes whose lane is started, or starting: a child forked from this process must not use them (see
# ``_forked``). One whose start failed stays here, neither started nor starting.
_STARTED_RUNTIMES: weakref.WeakSet[Runlane] = weakref.WeakSet()


def runtimes_started_on(loop: asyncio.AbstractEventLoop) -> list[Runlane]:
    """The open runtimes whose lane was started on ``loop`` (their connections live there): what a host
    that owns ``loop`` closes before it closes the loop."""
    return [runtime for runtime in list(_STARTED_RUNTIMES) if runtime._started and runtime._started_on is loop]


def _after_fork_in_child() -> None:
    parent = os.getppid()
    for runtime in list(_STARTED_RUNTIMES):
        # A start in progress, in another thread of the parent, never ends here: its lane is half started
        # on a loop the child does not run, and a call would wait for that start for ever.
        if runtime._started or runtime._starting is not None:
            runtime._forked(parent)
    _STARTED_RUNTIMES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _run_too_large(error: StorageLimitError, spec: _CreateInput) -> StorageLimitError:
    """``error`` of a run creation that does not fit the lane, saying so, what takes the room and what to
    do instead."""
    sizes = {  # in bytes, as the lane's limit counts them
        "payload": len(canonical_json(spec.payload).encode()),
        "meta": len(canonical_json(spec.meta or {}).encode()),
        "actor id": len((spec.actor.id or "").encode()),
    }
    largest = max(sizes, key=sizes.__getitem__)
    if error.reserved and error.actual - sum(sizes.values()) > error.allowed:
        # Not even an empty payload and meta would fit: the lane's record limit is too small for any run.
        limit = error.allowed + error.reserved
        message = (
            f"Run of task '{spec.definition.id}' cannot be stored on this lane whatever its payload: the lane's "
            f"{error.limit} of {limit:,} bytes, less the {error.reserved:,} bytes a run keeps free for what it "
            f"records as it runs, leaves {max(error.allowed, 0):,} bytes, and the run needs {error.actual:,} of "
            f"which its payload and meta take {sum(sizes.values()):,}. Nothing was written; the lane's storage "
            f"driver must advertise a larger {error.limit} (the bundled lanes have 400 KiB)."
        )
        return StorageLimitError(error.limit, error.allowed, error.actual, message, reserved=error.reserved)
    if spec.source is not None and spec.source.type in (RunSourceType.RERUN, RunSourceType.MANUAL_RETRY):
        # The payload is its source's, which fitted and the operator cannot change: name the largest part
        # of what this call adds (the meta and actor are the call's own, not copied from the source).
        added = {
            "meta": sizes["meta"] if spec.meta is not None else 0,
            "actor id": sizes["actor id"],
            "run_id": 0 if spec.generated_run_id else len(spec.run_id.encode()),
        }
        part = max(added, key=added.__getitem__)
        if error.actual - sum(added.values()) > error.allowed:
            # Even without them it would not fit: its payload, read back under the task's schema as
            # registered now, grew past what the source held (defaults of fields added since).
            advice = (
                f"its payload, the source's ({sizes['payload']:,} bytes as the task's schema reads it now), leaves "
                "no room for a new run on this lane: trigger one with a smaller payload (a reference to large data, "
                "such as an id or a URL) instead."
            )
        else:
            advice = (
                f"a rerun or retry repeats its source's payload ({sizes['payload']:,} bytes), so give it a shorter "
                f"run_id or actor id, or less meta (its {part} takes {added[part]:,} bytes)."
            )
    elif largest == "actor id":
        advice = f"its actor id takes {sizes[largest]:,} bytes: name the actor with a short id, such as a user id."
    else:
        advice = (
            f"its {largest} takes {sizes[largest]:,} bytes: pass a reference to large data (an id or a URL) in "
            f"the {largest} instead."
        )
    return StorageLimitError(
        error.limit,
        error.allowed,
        error.actual,
        error.too_large(f"Run of task '{spec.definition.id}'", f" Nothing was written; {advice}"),
        reserved=error.reserved,
    )


def _refused_for_queue(error: BaseException, queue: str) -> BaseException:
    """``error`` a transport raised publishing the wakeups of ``queue``, naming the queue in ``meta``
    (``queue``): it holds back that queue's wakeups only, so a maintenance loop reports it and goes on."""
    if not isinstance(error, RunlaneError) or "queue" in error.meta:
        return error
    return RunlaneError(
        error.code, error.message, retryable=error.retryable, meta={**error.meta, "queue": queue}, cause=error
    )


def _created_but_unpublished(error: RunlaneError, run: RunRecord) -> RunlaneError:
    """``error`` of a trigger's eager publish, saying that the run itself was created (the spec has
    the trigger reject; the caller must not trigger again as if nothing had been written)."""
    return RunlaneError(
        error.code,
        f"{error.message.rstrip('.')}. Run {run.id} was created and stays queued; tick() publishes its wakeup "
        "once this is fixed.",
        retryable=error.retryable,
        meta={**error.meta, "run_id": run.id},
    )


def _dispatch_timeout_ms(queue: QueueDefinition) -> int:
    return queue.dispatch_timeout_ms if queue.dispatch_timeout_ms is not None else _DEFAULT_LEASE_MS


# The most task ids one run listing filters by: each is a query parameter (Postgres takes 65,535 per
# statement, SQLite 32,766), and a longer list is better served by listing without it.
_MAX_FILTER_VALUES = 1000


def _listed(values: Any, field: str, what: str) -> tuple[Any, ...] | None:
    """A filter's values as a tuple, each once; one bare string is one value (``statuses="queued"``), not
    its letters. A filter that is no list of single values (``statuses=5``, ``statuses=[["queued"]]``) is
    ``validation_failed``, as a value of the wrong kind in the list is."""
    if values is None:
        return None
    if isinstance(values, str):
        return (values,)
    try:
        return tuple(dict.fromkeys(values))
    except TypeError:  # not iterable, or a member that is not hashable (so no single value either)
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED, f"{field} must be a list of {what}, got {values!r:.80}.", meta={"field": field}
        ) from None


def _whole(limit: Any) -> Any:
    """``limit`` unless it is not a whole number (``True`` or ``"2"`` would pass pydantic as 1 and 2)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED, f"limit must be a whole number, got {limit!r}.", meta={"fields": ["limit"]}
        )
    return limit


def _options_error(subject: str, error: ValueError) -> RunlaneError:
    """``validation_failed`` naming each bad option, what it must be and what it got (pydantic's own
    text would add the model's name and a documentation link)."""
    if not isinstance(error, ValidationError):
        return RunlaneError(ErrorCode.VALIDATION_FAILED, f"Invalid {subject} options: {error}")
    parts = []
    fields = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item["loc"]) or "options"
        fields.append(field)
        message = item["msg"]
        rule = message.removeprefix("Input should be ")
        said = f"{field} must be {rule}" if rule != message else f"{field}: {message}"
        parts.append(f"{said} (got {item.get('input')!r})")
    return RunlaneError(
        ErrorCode.VALIDATION_FAILED, f"Invalid {subject} options: {'; '.join(parts)}.", meta={"fields": fields}
    )


# ---------------------------------------------------------------------------------------------
# Namespaces


# ``runs.wait`` reads the run again after these many seconds, doubling up to the second.
_WAIT_FIRST_S = 0.01
_WAIT_MAX_S = 1.0


class RunsApi:
    """Operator reads and actions: ``runlane.runs``."""

    def __init__(self, runtime: Runlane) -> None:
        self._runtime = runtime

    async def get(self, run_id: str) -> RunRecord | None:
        """The run, or ``None`` when it does not exist or was pruned (hidden from the tombstoning commit)."""
        runtime = self._runtime
        runtime._check_open()
        self._operator_reads()
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        await runtime._ready()
        return await runtime._store.get_visible_run(checked)

    async def wait(self, run_id: str, *, timeout: Duration | None = None) -> RunRecord:
        """Wait until run ``run_id`` has finished (succeeded, failed or cancelled) and return it, as a
        producer that needs a run's result does. ``run_not_found`` when there is no such run (or it was
        pruned meanwhile); ``TimeoutError`` naming the run's status once ``timeout`` has passed (none:
        as long as it takes). A run that finishes in this process is returned as soon as its outcome is
        committed; the run is also read again at intervals growing from 10 ms to 1 s, so a run that
        finishes in another process is seen within a second. A retryable storage error (the database
        restarting) is waited out too; once the timeout has passed during one, it is raised."""
        runtime = self._runtime
        runtime._check_open()
        self._operator_reads()
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        refuse_waiting_for_its_own_run(runtime, checked, "runs.wait()")
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        if timeout is not None:
            limit_ms = duration_ms(timeout, "timeout")
            deadline = loop.time() + limit_ms / 1000
        await runtime._ready()
        interval = _WAIT_FIRST_S
        with runtime._finish_waiter(checked) as finished:  # registered before the first read: no commit is missed
            while True:
                runtime._check_open()  # closed meanwhile: its lane answers nothing more
                try:
                    run: RunRecord | None = await runtime._store.get_visible_run(checked)
                except RunlaneError as error:
                    # The lane closed under this read: say so, not what the closed lane answered (a
                    # closed pool's retryable storage_unavailable would be waited out to the timeout).
                    runtime._check_open()
                    # A storage outage (a database restarting) is waited out like the run itself, up to
                    # the timeout: the run goes on meanwhile, and the wait's caller only wants its end.
                    if not error.retryable or (deadline is not None and loop.time() >= deadline):
                        raise
                    run = None
                else:
                    if run is None:
                        raise run_not_found(checked, runtime._environment)
                    if run_status_values.is_terminal(run.status):
                        return run
                pause = interval
                if deadline is not None:
                    remaining = deadline - loop.time()
                    if remaining <= 0 and run is not None:
                        raise TimeoutError(
                            f"Run {checked} is still {run.status.value} after {format_duration(limit_ms)}."
                        )
                    pause = max(0.0, min(pause, remaining))
                if finished.done():
                    await asyncio.sleep(pause)
                else:
                    await asyncio.wait([finished], timeout=pause)
                interval = min(interval * 2, _WAIT_MAX_S)

    def _operator_reads(self) -> Any:
        runtime = self._runtime
        if not runtime._lane.capabilities.operator_reads:
            raise RunlaneError(
                ErrorCode.CAPABILITY_UNSUPPORTED,
                f"Lane {runtime._lane.name!r} has no operator reads, which runs.get/list/events/attempts/"
                "step/steps/wait/find_active/find_current and the cancel/rerun/retry actions need; use a lane "
                "created with operator_reads=True.",
            )
        return runtime._lane.storage

    async def list(
        self,
        *,
        cursor: str | None = None,
        limit: int | None = None,
        statuses: Sequence[RunStatus | RunStatusName] | None = None,
        task_ids: Sequence[TaskDefinition | str] | None = None,
        queues: Sequence[QueueDefinition | str] | None = None,
        idempotency_key: str | None = None,
        singleton_key: str | None = None,
        source_run_id: str | None = None,
        created_at: TimeRange | None = None,
        updated_at: TimeRange | None = None,
        run_at: TimeRange | None = None,
        sort_by: RunSortField | RunSortFieldName = RunSortField.CREATED_AT,
        sort_direction: SortDirection | SortDirectionName = SortDirection.DESC,
    ) -> Page[RunSummary]:
        runtime = self._runtime
        runtime._check_open()
        driver = self._operator_reads()
        queue_names = None if queues is None else runtime.filter_queue_names(queues)
        for what, key in (("idempotency key", idempotency_key), ("singleton key", singleton_key),
                          ("source run id", source_run_id)):  # fmt: skip
            if key is not None:
                validate_id(key, what, code=ErrorCode.VALIDATION_FAILED)
        # A task definition stands for its id, as in trigger() (and a queue definition for its name).
        given = (task_ids,) if isinstance(task_ids, TaskDefinition) else task_ids
        listed_task_ids = _listed(given, "task_ids", "task ids")  # the filter keeps each value once
        if listed_task_ids is not None:
            listed_task_ids = tuple(t.id if isinstance(t, TaskDefinition) else t for t in listed_task_ids)
        if listed_task_ids is not None and len(listed_task_ids) > _MAX_FILTER_VALUES:
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"A run listing filters by at most {_MAX_FILTER_VALUES:,} task ids, got {len(listed_task_ids):,}; "
                "list fewer at a time, or list without the filter.",
                meta={"field": "task_ids"},
            )
        for task_id in listed_task_ids or ():
            validate_id(task_id, "task id", code=ErrorCode.VALIDATION_FAILED)
        try:
            run_filter = RunFilter(
                environment=runtime._environment,
                statuses=_listed(statuses, "statuses", "run statuses"),
                task_ids=listed_task_ids,
                queues=queue_names,
                created_at=created_at,
                updated_at=updated_at,
                run_at=run_at,
                idempotency_key=idempotency_key,
                singleton_key=singleton_key,
                source_run_id=source_run_id,
                # The model validates a string and coerces it to the enum (or raises ValidationError).
                sort_by=cast(RunSortField, sort_by),
                sort_direction=cast(SortDirection, sort_direction),
            )
            pagination = PaginationParams(limit=_whole(limit), cursor=cursor)
        except ValueError as error:
            raise _options_error("run list", error) from None
        await runtime._ready()
        return await driver.list_runs(run_filter, pagination)

    async def events(
        self,
        run_id: str,
        *,
        cursor: str | None = None,
        limit: int | None = None,
        types: Sequence[RunEventType | RunEventTypeName] | None = None,
        occurred_at: TimeRange | None = None,
        sort_by: RunEventSortField | RunEventSortFieldName = RunEventSortField.OCCURRED_AT,
        sort_direction: SortDirection | SortDirectionName = SortDirection.ASC,
    ) -> Page[RunEventRecord]:
        runtime = self._runtime
        runtime._check_open()
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        driver = self._operator_reads()
        try:
            event_filter = RunEventFilter(
                environment=runtime._environment,
                run_id=checked,
                types=_listed(types, "types", "run event types"),
                occurred_at=occurred_at,
                # The model validates a string and coerces it to the enum (or raises ValidationError).
                sort_by=cast(RunEventSortField, sort_by),
                sort_direction=cast(SortDirection, sort_direction),
            )
            pagination = PaginationParams(limit=_whole(limit), cursor=cursor)
        except ValueError as error:
            raise _options_error("run event", error) from None
        await runtime._ready()
        if await runtime._store.get_visible_run(checked) is None:
            raise run_not_found(checked, runtime._environment)
        return await driver.list_run_events(event_filter, pagination)

    # ``builtins.list``: inside this class, ``list`` names the ``list`` method above.
    async def attempts(self, run_id: str) -> builtins.list[RunAttemptSummary]:
        """Attempt summaries derived from the run's event history."""
        records: builtins.list[RunEventRecord] = []
        cursor = None
        while True:
            page = await self.events(
                run_id, cursor=cursor, limit=contract_defaults.pagination.max_limit, sort_by=RunEventSortField.SEQUENCE
            )
            records.extend(page.data)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return _attempt_summaries(records)

    async def step(self, run_id: str, step_key: str) -> RunStepRecord | None:
        """What ``ctx.step.run(step_key, fn)`` stored for the run, or ``None`` when no attempt completed that
        step. A read only: nothing is called. An unknown or pruned run is ``run_not_found``."""
        runtime = self._runtime
        runtime._check_open()
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        key = validate_id(step_key, "step key", code=ErrorCode.VALIDATION_FAILED)
        self._operator_reads()
        await runtime._ready()
        if await runtime._store.get_visible_run(checked) is None:
            raise run_not_found(checked, runtime._environment)
        return await runtime._store.get_step(checked, key)

    async def steps(self, run_id: str, *, cursor: str | None = None, limit: int | None = None) -> Page[RunStepRecord]:
        """A page of the run's completed durable steps in step-key order; continue with ``next_cursor``.

        Read from the stored step records (never inferred from events or output). An unknown or pruned run
        is ``run_not_found``.
        """
        runtime = self._runtime
        runtime._check_open()
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        self._operator_reads()
        try:
            pagination = PaginationParams(limit=_whole(limit), cursor=cursor)
        except ValueError as error:
            raise _options_error("run step", error) from None
        wanted = clamp_page_limit(pagination.limit)
        scope = _step_cursor_scope(runtime._store.env_key, checked)
        after = _step_cursor_position(pagination.cursor, scope, checked)
        await runtime._ready()
        if await runtime._store.get_visible_run(checked) is None:
            raise run_not_found(checked, runtime._environment)
        steps, last = await runtime._store.list_steps(checked, after=after, limit=wanted)
        kind = PaginationCursorKind.RUN_STEP_LIST
        next_cursor = None if last is None else encode_operator_cursor(kind, scope, (last,))
        return Page[RunStepRecord](data=steps, next_cursor=next_cursor)

    async def find_active(
        self, *, task: TaskDefinition | str, idempotency_key: str | None = None, singleton_key: str | None = None
    ) -> RunRecord | None:
        """Advisory lookup of an active run for a task by idempotency or singleton key."""
        runtime = self._runtime
        runtime._check_open()
        self._operator_reads()
        definition = runtime.resolve_task(task)
        if idempotency_key is None and singleton_key is None:
            raise _invalid("find_active() needs idempotency_key or singleton_key.", field="idempotency_key")
        # Lookup keys of an operator read, as runs.list() filters are: a malformed one is validation_failed.
        if idempotency_key is not None:
            idempotency_key = validate_id(idempotency_key, "idempotency key", code=ErrorCode.VALIDATION_FAILED)
        if singleton_key is not None:
            singleton_key = validate_id(singleton_key, "singleton key", code=ErrorCode.VALIDATION_FAILED)
        await runtime._ready()
        # Like a run filter, every key given must match: look the run up by one owner, check the rest.
        if idempotency_key is not None:
            run = await runtime._store.find_idempotent_run(definition.id, idempotency_key)
        else:  # no idempotency key, so the singleton key is set (checked above)
            run = await runtime._store.find_singleton_run(cast(str, singleton_key))
        if run is None or run.status in _TERMINAL or run.task_id != definition.id:
            return None
        if singleton_key is not None and run.singleton_key != singleton_key:
            return None
        return run

    async def find_current(self, *, task: TaskDefinition | str, idempotency_key: str) -> RunRecord | None:
        """The active or retained terminal owner of one idempotency key."""
        runtime = self._runtime
        runtime._check_open()
        self._operator_reads()
        definition = runtime.resolve_task(task)
        # A lookup key of an operator read, as in find_active() and runs.list(): validation_failed.
        key = validate_id(idempotency_key, "idempotency key", code=ErrorCode.VALIDATION_FAILED)
        await runtime._ready()
        return await runtime._store.find_idempotent_run(definition.id, key)

    async def rerun(
        self,
        source_run_id: str,
        *,
        actor: Actor | None = None,
        meta: Mapping[str, Any] | None = None,
        trace_carrier: Mapping[str, str] | None = None,
        queue: QueueDefinition | str | None = None,
        run_id: str | None = None,
    ) -> RunRecord:
        """Create a new linked run from a terminal source run (``source.type = rerun``)."""
        return await self._linked(
            source_run_id, RunSourceType.RERUN, actor=actor, meta=meta, trace_carrier=trace_carrier, queue=queue, run_id=run_id
        )

    async def retry(
        self,
        source_run_id: str,
        *,
        actor: Actor | None = None,
        meta: Mapping[str, Any] | None = None,
        trace_carrier: Mapping[str, str] | None = None,
        queue: QueueDefinition | str | None = None,
        run_id: str | None = None,
    ) -> RunRecord:
        """Create a recovery run from a failed source run (``source.type = manual_retry``)."""
        return await self._linked(
            source_run_id,
            RunSourceType.MANUAL_RETRY,
            actor=actor,
            meta=meta,
            trace_carrier=trace_carrier,
            queue=queue,
            run_id=run_id,
        )

    async def _linked(
        self,
        source_run_id: str,
        kind: RunSourceType,
        *,
        actor: Actor | None,
        meta: Mapping[str, Any] | None,
        trace_carrier: Mapping[str, str] | None,
        queue: QueueDefinition | str | None,
        run_id: str | None,
    ) -> RunRecord:
        runtime = self._runtime
        runtime._check_open()
        self._operator_reads()
        checked = validate_id(source_run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        await runtime._ready()
        source = await runtime._store.get_visible_run(checked)
        if source is None:
            raise run_not_found(checked, runtime._environment)
        if source.status not in _TERMINAL:
            # An active run goes on through its own lifecycle (its own retries included) and neither action
            # may overlap it: say how to get to a finished run, whichever action was asked for.
            wait = f"Wait for it to finish (runs.wait(), or runlane runs wait {checked})"
            if kind is RunSourceType.RERUN:
                advice = (
                    f"only a finished run (succeeded, failed or cancelled) can be rerun. {wait}, or cancel it and "
                    "rerun it once it is cancelled."
                )
            else:
                advice = f"manual retry needs a failed run. {wait}: retry it if it failed, rerun it otherwise."
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"Run {checked} is still {source.status.value}; {advice}",
                meta={"run_id": checked, "status": source.status.value},
            )
        if kind is RunSourceType.MANUAL_RETRY and source.status is not RunStatus.FAILED:
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"Run {checked} is {source.status.value}; manual retry needs a failed run "
                "(use rerun for other terminal runs).",
                meta={"run_id": checked, "status": source.status.value},
            )
        # The source's keys protect the same resource as before: a child must not overlap active work
        # holding its singleton key, and stays in its concurrency partition on any bounded queue (an
        # unbounded queue cannot enforce one, so a child moved there has none).
        target = None if queue is None else runtime.resolve_queue(queue)
        if target is None and source.queue not in runtime.queues:
            # The child would take the source's queue, which a later release renamed or removed: say that
            # it is the source's, and how to choose another, instead of naming a queue the caller never gave.
            runtime.resolve_task(source.task_id)  # a missing task is task_not_found first, as the spec says
            verb = "rerun" if kind is RunSourceType.RERUN else "retry"
            raise _invalid(
                f"Run {checked} ran on queue {source.queue!r}, which is not registered in this runtime (registered "
                f"queues: {sorted(runtime.queues)}); pass a registered queue (queue=, or --queue) to {verb} it there.",
                field="queue",
                queue=source.queue,
                run_id=checked,
            )
        bounded = target is None or target.concurrency_limit is not None
        spec = runtime.prepare_create(
            source.task_id,
            source.payload,
            actor=_OPERATOR_ACTOR if actor is None else actor,
            meta=meta,
            queue=source.queue if target is None else target,
            run_id=run_id,
            trace_carrier=source.trace_carrier if trace_carrier is None else trace_carrier,
            singleton_key=source.singleton_key,
            concurrency_key=source.concurrency_key if bounded else None,
            source=RunSource(type=kind, source_run_id=source.id),
            stored=True,
            linked=True,
        )
        return (await runtime.create_triggered(spec)).run

    async def cancel(
        self,
        run_id: str,
        *,
        actor: Actor | None = None,
        reason: str | None = None,
        meta: Mapping[str, Any] | None = None,
        trace_carrier: Mapping[str, str] | None = None,
    ) -> RunRecord:
        """Cancel a waiting run now, or request cooperative cancellation of a running one."""
        runtime = self._runtime
        runtime._check_open()
        self._operator_reads()
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        actor = checked_actor(actor, _OPERATOR_ACTOR)
        checked_reason(reason)
        meta_value = None if meta is None else _copy_json_object(meta, "meta")
        carrier = _trace_carrier(trace_carrier)
        await runtime._ready()

        def build(run: RunRecord, at: datetime) -> list[RunEvent]:
            status = run.status
            if status in _TERMINAL:
                raise RunlaneError(
                    ErrorCode.VALIDATION_FAILED,
                    f"Run {run.id} is already {status.value}; terminal runs cannot be cancelled.",
                    meta={"run_id": run.id, "status": status.value},
                )
            common: dict[str, Any] = dict(
                run_id=run.id, environment=run.environment, occurred_at=at, actor=actor, meta=meta_value,
                trace_carrier=carrier, reason=reason,
            )
            if status in _DIRECTLY_CANCELLABLE:
                return [RunCancelledEvent(**common)]
            if status is RunStatus.RUNNING:
                return [RunCancellationRequestedEvent(**common)]
            return []  # already cancellation_requested: no duplicate event

        (result,) = await runtime.append_many([CompletionRequest(checked, build)])
        if isinstance(result, StorageLimitError):
            raise StorageLimitError(
                result.limit,
                result.allowed,
                result.actual,
                result.too_large(
                    f"The cancellation of run {checked} with its reason, meta and actor id",
                    " Nothing was written; cancel with a shorter reason and actor id and smaller meta.",
                ),
                reserved=result.reserved,
            )
        if isinstance(result, RunlaneError):
            if result.code is ErrorCode.VALIDATION_FAILED and await runtime._store.get_visible_run(checked) is None:
                # A pruned run is terminal (the build refused it) and, for operators, gone.
                raise run_not_found(checked, runtime._environment)
            raise result
        run = result.run
        if run.status is RunStatus.CANCELLATION_REQUESTED and run.lease is not None:
            if not runtime.registry.notify_cancellation(run.id, run.lease.worker_id, run.lease.token):
                # Its attempt runs in another process: ask that one to heartbeat now, which observes the
                # request, instead of at its next interval (half the lease: minutes by default).
                runtime.hint_cancellation(run.id)
        return run

    async def prune(
        self,
        *,
        older_than: Duration | timedelta | datetime,
        statuses: Sequence[RunStatus | RunStatusName] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        actor: Actor | None = None,
    ) -> PruneResult:
        """Prune terminal runs last updated before ``older_than`` (a duration such as ``"30d"`` before now,
        or an aware ``datetime`` cutoff), at most ``limit`` per call, then clean up a bounded amount of
        pruned records. Active runs are never pruned. Continue with ``next_cursor`` and the same
        ``older_than`` and ``statuses`` until it is ``None``.
        """
        runtime = self._runtime
        runtime._check_open()
        actor = checked_actor(actor, _OPERATOR_ACTOR)  # an option, as on cancel, retry and rerun
        now = runtime.now()
        cutoff, chosen, wanted = resolve_prune_request(
            older_than=older_than,
            statuses=statuses,
            limit=limit,
            cursor=cursor,
            now=now,
            environment=runtime._environment,
        )
        await runtime._ready()
        pruner = RunPruner(runtime._store.driver, runtime._environment)
        return await pruner.prune(
            older_than=cutoff,
            statuses=chosen,
            limit=wanted,
            cursor=cursor,
            actor=actor,
            now=now,
            older_than_ms=older_than_ms(older_than),
        )


# How many more times ``signals.send`` tries a run whose resume write storage gave up on.
_SEND_CONFLICT_RETRIES = 2


class SignalsApi:
    """``runlane.signals.send(signal_key)``: resume runs released until a signal."""

    def __init__(self, runtime: Runlane) -> None:
        self._runtime = runtime

    async def send(self, signal_key: str, *, limit: int | None = None) -> list[RunRecord]:
        """Append ``run.delivery_requested`` to runs still waiting on ``signal_key``; returns those runs."""
        runtime = self._runtime
        runtime._check_open()
        key = validate_id(signal_key, "signal key")
        wanted = _limit(limit, "limit", _MAINTENANCE.delivery_request_limit)
        await runtime._ready()
        build = _resume_build(lambda wait: wait.type is RunWaitConditionType.SIGNAL and wait.signal_key == key)
        page = runtime._store.driver.profile.limits.max_query_results
        resumed: list[RunRecord] = []
        # Runs another sender resumed first (or that stopped waiting meanwhile) leave the index with
        # that commit: the next page skips them, so a racing sender still resumes up to its limit.
        seen: set[str] = set()
        # A write the driver gave up on (storage_conflict once its own retries are spent: a busy bounded
        # queue's capacity row, other senders) resumed none of its runs. Those still waiting are in the
        # index: they are tried again, and when storage keeps refusing, the conflict is raised so that
        # the caller sends again; skipping them would leave them waiting while the send looks complete.
        conflicts: dict[str, int] = {}
        # A key past 256 bytes is indexed by its digest; runs an earlier release left waiting on such a
        # key are indexed by the key itself, so that partition is read too.
        for partition in dict.fromkeys((signal_wait_partition(key), key)):
            while len(resumed) < wanted:
                asked = min(page, wanted - len(resumed))
                requested = min(page, asked + len(seen))
                found = await runtime._store.query_index(
                    StorageIndexName.RUNS_WAITING_FOR_SIGNAL, (partition,), limit=requested
                )
                unseen = [run_id for run_id in found if run_id not in seen]
                run_ids = unseen[:asked]
                if not run_ids:
                    break
                seen.update(run_ids)
                results = await runtime.append_many([CompletionRequest(run_id, build) for run_id in run_ids])
                await runtime.publish_resumed(results)
                again = False
                for run_id, result in zip(run_ids, results):
                    if isinstance(result, AppendResult):
                        if result.events:
                            resumed.append(result.run)
                    elif is_storage_conflict(result):
                        conflicts[run_id] = conflicts.get(run_id, 0) + 1
                        if conflicts[run_id] > _SEND_CONFLICT_RETRIES:
                            raise result
                        seen.discard(run_id)
                        again = True
                    elif result.code is not ErrorCode.RUN_NOT_FOUND:
                        raise result
                if not again and len(found) < requested and len(unseen) == len(run_ids):
                    break  # the index had no more rows than this page, and each was tried
        return resumed


class ObservationsApi:
    """``runlane.observations``: this environment's durable observation stream and consumer checkpoints."""

    def __init__(self, runtime: Runlane) -> None:
        self._runtime = runtime

    async def scan(self, cursor: str | None = None, limit: int | None = None) -> ObservationPage:
        """Observation records after ``cursor`` in stream (commit) order; the page's ``cursor`` continues
        after its last record."""
        runtime = self._runtime
        runtime._check_open()
        await runtime._ready()
        return await scan_observation_records(runtime._store.driver, runtime._environment, cursor=cursor, limit=limit)

    async def checkpoint(self, consumer: str) -> str | None:
        """The cursor ``consumer`` last checkpointed (``None`` before its first export)."""
        runtime = self._runtime
        runtime._check_open()
        await runtime._ready()
        return await get_observation_checkpoint(runtime._store.driver, runtime._environment, consumer)

    async def trim(
        self,
        *,
        older_than: Duration | timedelta | datetime,
        consumers: Sequence[str] | None = (),
        limit: int | None = None,
    ) -> ObservationTrimResult:
        """Delete observation records recorded before ``older_than`` (a duration before now, such as
        ``"7d"``, or an aware ``datetime``), oldest first, at most ``limit`` (1,000 by default) per call;
        call again while ``more``. Records a consumer named in ``consumers`` has not exported yet are
        kept. Run history is not touched (``runs.prune`` is its retention): this is the stream's.
        """
        runtime = self._runtime
        runtime._check_open()
        cutoff = resolve_older_than(older_than, runtime.now())
        if consumers is None:
            consumers = ()
        elif isinstance(consumers, str):
            consumers = [consumers]
        elif not isinstance(consumers, Iterable) or isinstance(consumers, (bytes, Mapping)):
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"consumers must be a list of consumer names, got {type(consumers).__name__}.",
                meta={"field": "consumers"},
            )
        await runtime._ready()
        return await trim_observation_records(
            runtime._store.driver,
            runtime._environment,
            recorded_before=cutoff,
            consumers=list(consumers),
            limit=1000 if limit is None else limit,
        )


class _ReadyStorage:
    """The runtime's storage driver for an exporter: every call starts the runtime first (like every
    runtime method) and fails once it is closed."""

    def __init__(self, runtime: Runlane) -> None:
        driver = runtime._store.driver
        self._runtime = runtime
        self._driver = driver
        self.name = driver.name
        self.profile = driver.profile

    async def get(self, keys: Sequence[Any]) -> list[Any]:
        await self._runtime._ready()
        return await self._driver.get(keys)

    async def query(self, query: Any) -> Any:
        await self._runtime._ready()
        return await self._driver.query(query)

    async def with_transaction(self, callback: Callable[[Any], Any]) -> Any:
        await self._runtime._ready()
        return await self._driver.with_transaction(callback)


class IdempotencyKeysApi:
    """``runlane.idempotency_keys.reset(task, key=...)``: clear one retained terminal owner."""

    def __init__(self, runtime: Runlane) -> None:
        self._runtime = runtime

    async def reset(self, task: TaskDefinition | str, *, key: str) -> None:
        runtime = self._runtime
        runtime._check_open()
        definition = runtime.resolve_task(task)
        checked = validate_id(key, "idempotency key")
        await runtime._ready()
        active = await runtime._store.reset_idempotency_key(definition.id, checked)
        if active is not None:
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                f"Idempotency key {checked!r} of task {definition.id!r} is owned by active run {active.id}; "
                "reset only clears retained terminal owners.",
                meta={"run_id": active.id, "task_id": definition.id, "idempotency_key": checked},
            )


# ---------------------------------------------------------------------------------------------
# Construction


# An environment's name is part of every key and index entry the lane writes, twice in some: a bound in
# bytes keeps the longest ids and keys storable on every lane (see ``MAX_INDEX_ENTRY_BYTES`` of Postgres).
_MAX_ENVIRONMENT_BYTES = 200


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name)} characters)"


def environment_name_problem(name: str) -> str | None:
    """What keeps a non-empty ``name`` from naming an environment every lane can store, or ``None``: NUL
    (Postgres text refuses it), a lone surrogate (no storage encodes it; it is what bytes that are not
    UTF-8 become in an environment variable), or more than ``_MAX_ENVIRONMENT_BYTES`` of UTF-8."""
    if "\x00" in name:
        return "it contains NUL"
    if not is_unicode_text(name):
        return "it has a lone surrogate (bytes that are not UTF-8, as in a variable or a command line)"
    if len(name.encode("utf-8")) > _MAX_ENVIRONMENT_BYTES:
        return f"it is longer than {_MAX_ENVIRONMENT_BYTES} bytes of UTF-8"
    return None


def _check_environment_name(name: str) -> None:
    problem = environment_name_problem(name)
    if problem is not None:
        raise _invalid(
            f"Invalid environment {_shown(name)}: {problem}; name it with plain text, such as 'production'.",
            field="environment",
        )


def create_runlane(
    *,
    lane: Lane,
    queues: Sequence[QueueDefinition],
    tasks: Sequence[TaskDefinition] | Mapping[str, TaskDefinition] = (),
    environment: str | Environment = contract_defaults.environment,
    dispatch: TriggerDispatchMode | TriggerDispatchModeName = TriggerDispatchMode.EAGER,
    clock: Clock | None = None,
    worker_id: str | None = None,
    observers: Sequence[Callable[[RunlaneObservation], Any]] = (),
    on_observer_error: Callable[[BaseException, RunlaneObservation], Any] | None = None,
) -> Runlane:
    """Build a runtime over ``lane`` with a queue registry and a task catalog (checked for drift)."""
    if not isinstance(lane, Lane):
        raise _invalid(f"lane must be a Lane (local_lane(), create_lane(...)), got {lane!r}.", field="lane")

    if isinstance(queues, (str, QueueDefinition)) or not isinstance(queues, Sequence):
        raise _invalid("queues must be a list of queue(...) definitions.", field="queues")
    queue_map: dict[str, QueueDefinition] = {}
    default_queue: QueueDefinition | None = None
    for queue_def in queues:
        if not isinstance(queue_def, QueueDefinition):
            raise _invalid(f"Every queue must come from queue(...), got {queue_def!r}.", field="queues")
        if queue_def.name in queue_map:
            raise _invalid(f"Queue {queue_def.name!r} is registered twice; queue names must be unique.", field="queues")
        queue_map[queue_def.name] = queue_def
        if queue_def.default:
            if default_queue is not None:
                raise _invalid(
                    f"Queues {default_queue.name!r} and {queue_def.name!r} are both marked default; mark only one.",
                    field="queues",
                )
            default_queue = queue_def
    if not queue_map:
        raise _invalid("create_runlane() needs at least one queue: queues=[queue('default', default=True)].", field="queues")
    _check_transport_bindings(lane, queue_map)

    task_map: dict[str, TaskDefinition] = {}
    if isinstance(tasks, Mapping):
        entries: list[tuple[str | None, object]] = list(tasks.items())
    elif isinstance(tasks, (str, TaskDefinition)) or not isinstance(tasks, Iterable):
        raise _invalid("tasks must be a list of task definitions or a {name: task} mapping.", field="tasks")
    else:
        entries = [(None, item) for item in tasks]
    by_id: dict[str, TaskDefinition] = {}
    for name, item in entries:
        if not isinstance(item, TaskDefinition):
            raise _invalid(f"Every task must be a TaskDefinition from @task(...), got {item!r}.", field="tasks")
        if name is not None and (not isinstance(name, str) or not name):
            raise _invalid(f"Task catalog names must be non-empty strings, got {name!r}.", field="tasks")
        existing = by_id.get(item.id)
        if existing is not None and existing is not item:
            raise _invalid(
                f"Two different task definitions use id {item.id!r}; task ids must be unique.", field="tasks", task_id=item.id
            )
        by_id[item.id] = item
        task_map[item.id if name is None else name] = item
        if item.queue is not None:
            _check_registered_queue(queue_map, item.queue, f"Task {item.id!r}")
            if item.concurrency_key is not None and not item.queue.is_bounded:
                raise _invalid(
                    f"Task {item.id!r} sets concurrency_key but its queue {item.queue.name!r} has no concurrency_limit.",
                    field="concurrency_key",
                    task_id=item.id,
                )
    # A task without a queue in a runtime without a default queue is fine as long as every run of it
    # names a queue (trigger(queue=...)); a schedule of it must name one itself, since nothing else will.
    schedule_owners: dict[str, str] = {}
    for item in by_id.values():
        for entry in item.schedules:
            owner = schedule_owners.get(entry.id)
            if owner is not None:
                users = f"task {item.id!r} twice" if owner == item.id else f"tasks {owner!r} and {item.id!r}"
                raise _invalid(
                    f"Schedule id {entry.id!r} is used by {users}; schedule ids must be unique across the runtime "
                    "(they name durable occurrences).",
                    field="schedule",
                    schedule_id=entry.id,
                )
            schedule_owners[entry.id] = item.id
            if entry.queue is None and item.queue is None and default_queue is None:
                raise _invalid(
                    f"Schedule {entry.id!r} of task {item.id!r} has no queue to run on: neither the schedule nor "
                    "the task names one and no registered queue is marked default; pass queue= to the schedule "
                    "or the task, or mark one queue default=True.",
                    field="queue",
                    task_id=item.id,
                    schedule_id=entry.id,
                )
            if entry.queue is not None:
                _check_registered_queue(queue_map, entry.queue, f"Schedule {entry.id!r} of task {item.id!r}")
            # The queue the schedule's runs land on: the schedule's, else the task's, else the default.
            lands_on = entry.queue or item.queue or default_queue
            if item.concurrency_key is not None and lands_on is not None and not lands_on.is_bounded:
                raise _invalid(
                    f"Task {item.id!r} sets concurrency_key but schedule {entry.id!r} runs it on queue "
                    f"{lands_on.name!r}, which has no concurrency_limit; pass a bounded queue to the schedule "
                    "or set concurrency_limit on that queue.",
                    field="concurrency_key",
                    task_id=item.id,
                    schedule_id=entry.id,
                )

    if isinstance(environment, str):
        _check_environment_name(environment)
        try:
            env = Environment.model_validate({"name": environment})
        except ValidationError as error:
            reason = error.errors()[0]["msg"].lower()
            raise _invalid(f"Invalid environment {_shown(environment)}: {reason}.", field="environment") from None
    elif isinstance(environment, Environment):
        _check_environment_name(environment.name)
        env = environment
    else:
        raise _invalid(f"environment must be a name or an Environment, got {environment!r}.", field="environment")

    try:
        dispatch_mode = TriggerDispatchMode(dispatch)
    except ValueError:
        raise _invalid(f"Unknown dispatch mode {dispatch!r}; use TriggerDispatchMode.EAGER or DEFERRED.", field="dispatch") from None

    if clock is None:
        runtime_clock: Any = SystemClock()
    elif callable(getattr(clock, "now", None)):
        # Read once now, so a clock that cannot tell the time fails here rather than in the first call
        # that needs it (storage samples the same clock, and would report it only at its first write).
        _clock_reading_in_utc(clock, _read_clock(clock))
        runtime_clock = clock
        _hand_clock_to_storage(lane, clock)
    else:
        raise _invalid(f"clock must be an object with a now() method, got {clock!r}.", field="clock")

    owner = _default_worker_id() if worker_id is None else validate_id(worker_id, "worker id")

    if isinstance(observers, Iterable) and not isinstance(observers, (str, bytes)):
        observer_list = list(observers)
    else:
        raise _invalid("observers must be a list of functions.", field="observers")
    for observer in observer_list:
        if not callable(observer):
            raise _invalid(f"Every observer must be a function, got {observer!r}.", field="observers")
    if on_observer_error is not None and not callable(on_observer_error):
        raise _invalid(f"on_observer_error must be a function, got {on_observer_error!r}.", field="on_observer_error")

    runtime = Runlane(
        lane=lane,
        queues=queue_map,
        tasks=task_map,
        tasks_by_id=by_id,
        default_queue=default_queue,
        environment=env,
        dispatch=dispatch_mode,
        clock=runtime_clock,
        worker_id=owner,
        observers=observer_list,
        on_observer_error=on_observer_error,
    )
    runtime._check_scheduled_runs_fit()
    runtime._check_queue_capacity_fits()
    return runtime


def _check_registered_queue(queues: Mapping[str, QueueDefinition], queue: QueueDefinition, owner: str) -> None:
    registered = queues.get(queue.name)
    if registered is None:
        raise _invalid(
            f"{owner} uses queue {queue.name!r}, which is not registered; add it to create_runlane(queues=...).",
            field="queues",
            queue=queue.name,
        )
    if registered != queue:
        raise _invalid(
            f"{owner} uses a queue {queue.name!r} that differs from the registered definition (drift); "
            "use one queue(...) object everywhere.",
            field="queues",
            queue=queue.name,
        )


def _check_transport_bindings(lane: Lane, queues: Mapping[str, QueueDefinition]) -> None:
    """A transport that exposes ``queues`` (its provider bindings) binds exactly the registered queues.

    A binding is a ``QueueDefinition`` (checked for policy drift like a task's queue) or a queue name.
    Every registered queue needs one, or its wakeups would have nowhere to go.
    """
    transport = lane.delivery.transport
    bound = getattr(transport, "queues", None) if transport is not None else None
    if bound is None:
        return
    owner = f"Transport {transport.name!r}"  # type: ignore[union-attr]
    names: set[str] = set()
    for binding in bound:
        if isinstance(binding, QueueDefinition):
            _check_registered_queue(queues, binding, f"{owner} binding")
            names.add(binding.name)
        elif isinstance(binding, str) and binding in queues:
            names.add(binding)
        else:
            raise _invalid(
                f"{owner} binds queue {binding!r}, which is not registered; "
                "add it to create_runlane(queues=...) or remove the binding.",
                field="queues",
                queue=str(binding),
            )
    missing = [name for name in queues if name not in names]
    if missing:
        raise _invalid(
            f"{owner} has no binding for queue{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(name) for name in missing)}; its wakeups would have nowhere to go. Bind every "
            f"registered queue (with runlane-sqs: a [lane.sqs.queues.{missing[0]}] table in runlane.toml, or "
            "sqs_queue(...)).",
            field="queues",
            queues=missing,
        )


def _hand_clock_to_storage(lane: Lane, clock: Any) -> None:
    """Client-clock storage samples the runtime's clock in every transaction.

    A client-clock driver opts in with a public ``use_clock(clock)`` method (the in-memory driver has
    one); a driver without it keeps its own clock.
    """
    if lane.capabilities.storage.clock_authority is not StorageClockAuthority.CLIENT:
        return
    use_clock = getattr(lane.storage, "use_clock", None)
    if callable(use_clock):
        use_clock(clock)


def _default_worker_id() -> str:
    return f"worker_{os.getpid()}_{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------------------------
# Small helpers


def _limit(value: object, what: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid(f"{what} must be a positive whole number, got {value!r}.", field=what)
    return value


def _copy_json_object(value: object, what: str) -> dict[str, Any]:
    checked = ensure_json_object(value, what, code=ErrorCode.CONFIGURATION_INVALID)
    return json.loads(canonical_json(checked))


#: The most a trace carrier may hold, in UTF-8 bytes of its keys and values. A carrier is trace headers
#: (``traceparent``, ``tracestate``, W3C ``baggage`` of at most 8 KiB) or request correlation, and it
#: rides in every wakeup of its run: one far larger would make wakeups that transports and consumers
#: refuse (SQS consumers read at most 256 KiB, JSON escapes included), leaving the run queued with nothing
#: to wake it.
MAX_TRACE_CARRIER_BYTES = 16 * 1024


def _trace_carrier(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _invalid("trace_carrier must be a mapping of strings to strings.", field="trace_carrier")
    for key, item in value.items():
        if not (is_unicode_text(key) and is_unicode_text(item)):
            # Refused here, as in meta: storage would refuse the run's documents as a driver contract breach.
            raise _invalid(
                f"trace_carrier entry {key!r} is not valid Unicode text (it has a lone surrogate, which is what bytes "
                "that are not UTF-8 become when decoded with surrogateescape); pass UTF-8 text.",
                field="trace_carrier",
            )
    size = sum(len(key.encode("utf-8")) + len(item.encode("utf-8")) for key, item in value.items())
    if size > MAX_TRACE_CARRIER_BYTES:
        raise _invalid(
            f"trace_carrier holds {size:,} bytes of keys and values, more than the {MAX_TRACE_CARRIER_BYTES:,} a "
            "trace carrier may: it travels with every wakeup of the run. Pass trace headers and correlation ids "
            "only; put larger context in the payload or meta.",
            field="trace_carrier",
            max_bytes=MAX_TRACE_CARRIER_BYTES,
        )
    return dict(value)


def _json_meta(meta: Any) -> dict[str, Any]:
    """An error's ``meta`` when it is a JSON object, else an empty object (failure records stay valid)."""
    try:
        return dict(ensure_json_object(meta, "meta"))
    except (RunlaneError, TypeError, ValueError):
        return {}


def _delivery_event(run: RunRecord, at: datetime, actor: Actor) -> RunDeliveryRequestedEvent:
    return RunDeliveryRequestedEvent(
        run_id=run.id,
        environment=run.environment,
        occurred_at=at,
        actor=actor,
        delivery=DeliveryIntent(environment=run.environment, run_id=run.id, queue=run.queue, requested_at=at, available_at=at),
    )


def _resume_build(matches: Callable[[Any], bool]) -> Callable[[RunRecord, datetime], list[RunEvent]]:
    def build(run: RunRecord, at: datetime) -> list[RunEvent]:
        wait = run.wait
        if run.status is not RunStatus.RELEASED or wait is None or not matches(wait):
            return []
        return [_delivery_event(run, at, _SYSTEM_ACTOR)]

    return build


async def _fail_claimed(runtime: Runlane, run: RunRecord, failure: RunFailure) -> AttemptResult:
    """Persist a non-retryable failure for a claimed run that this runtime cannot execute."""
    assert run.lease is not None
    token = run.lease.token
    actor = Actor(type=ActorType.WORKER, id=run.lease.worker_id)

    def build(current: RunRecord, at: datetime) -> list[RunEvent]:
        return failure_outcome_events(current, at, failure, None, actor, allow_retry=False)

    try:
        result = await runtime.loop_state().completions.submit(CompletionRequest(run.id, build, token, run))
    except RunlaneError as error:
        if is_storage_conflict(error, StorageConflictKind.LEASE_OWNERSHIP):
            return AttemptResult(None, True, error)
        raise
    await runtime.after_append(result)
    return AttemptResult(result.run, False, None)


def _step_cursor_scope(env_key: str, run_id: str) -> dict[str, Any]:
    return {"environment": env_key, "run_id": run_id}


def _step_cursor_position(cursor: str | None, scope: dict[str, Any], run_id: str) -> str | None:
    """The step key a ``runs.steps`` cursor continues after (``None`` without a cursor)."""
    try:
        last = decode_operator_cursor(cursor, PaginationCursorKind.RUN_STEP_LIST, scope)
    except RunlaneError as error:
        raise RunlaneError(
            error.code, f"Invalid cursor for the steps of run {run_id}: {error.message}", meta=error.meta
        ) from None
    if last is None:
        return None
    if len(last) != 1 or not is_step_position(last[0]):
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED,
            f"Invalid cursor for the steps of run {run_id}: malformed position; restart the listing without a cursor.",
            meta={"field": "cursor"},
        )
    return last[0]


def _attempt_summaries(records: Sequence[RunEventRecord]) -> list[RunAttemptSummary]:
    """A summary per started attempt. One whose run was made due again (its lease expired) or claimed anew
    before it recorded an outcome stays ``running``: it ended with none, and what the run records later
    (a cancellation of the run queued again, say) is no outcome of it."""
    summaries: list[dict[str, Any]] = []
    over = False  # the latest attempt ended without an outcome
    for record in sorted(records, key=lambda item: item.sequence):
        event = record.event
        if isinstance(event, RunStartedEvent):
            summaries.append({"attempt": event.attempt, "started_at": event.occurred_at, "status": RunAttemptStatus.RUNNING})
            over = False
            continue
        if not summaries or over:
            continue
        current = summaries[-1]
        if current["status"] is not RunAttemptStatus.RUNNING:
            continue
        if isinstance(event, (RunDeliveryRequestedEvent, RunLeaseClaimedEvent)):
            over = True
            continue
        if isinstance(event, RunSucceededEvent):
            current.update(status=RunAttemptStatus.SUCCEEDED, completed_at=event.occurred_at, has_output=event.has_output)
            if event.has_output:
                current["output"] = event.output
        elif isinstance(event, RunFailedEvent):
            current.update(status=RunAttemptStatus.FAILED, completed_at=event.occurred_at, failure=event.failure)
        elif isinstance(event, RunRetryScheduledEvent):
            current.update(
                status=RunAttemptStatus.RETRYING,
                completed_at=event.occurred_at,
                failure=event.failure,
                retry_delay=event.delay,
                retry_at=event.retry_at,
            )
        elif isinstance(event, RunReleasedEvent):
            current.update(
                status=RunAttemptStatus.RELEASED,
                completed_at=event.occurred_at,
                release_delay=event.delay,
                release_wait=event.wait,
                release_reason=event.reason,
                resume_at=event.resume_at,  # time releases only; a wait's timeout stays on release_wait
            )
        elif isinstance(event, RunCancelledEvent):
            current.update(status=RunAttemptStatus.CANCELLED, completed_at=event.occurred_at)
    return [RunAttemptSummary(**summary) for summary in summaries]
