"""The post-lease attempt path every execution path shares, ``TaskContext`` and durable steps.

After a lease is claimed (``execute_next``, workers, ``execute_delivery``) or created with the run
(``run_now``), ``execute_claimed_run`` does the same thing: re-validate the persisted payload, build
the ``TaskContext``, run the handler (``async def`` on the event loop, ``def`` on a thread of the
runtime's ``handler_threads``, one per running handler), heartbeat every ``heartbeat_interval``, abort
the context signal at the fixed attempt deadline, on a same-process cancellation request or when the
worker stops, and persist exactly one outcome fenced by the lease: succeeded, failed, retry
scheduled, released or cancelled.

Outcome rules (the reducer enforces the lifecycle; this module picks the event):

* the completion is decided inside the storage transaction from the run as stored then, so a
  cancellation request that lands while the handler runs turns a normal return into ``cancelled``
  and a failure into ``failed`` with no retry;
* an attempt that finishes after its deadline fails with ``task_timed_out`` (retry policy applies);
* unknown exceptions become ``task_failed`` / "Task failed." (retryable); ``RunlaneError`` keeps its
  code, meta and retryability with a task-facing message;
* a lost lease (heartbeat or completion) abandons the attempt: nothing is persisted for it.

History keeps only the sanitized failure. The process's own log gets the detail: an attempt that
ends in ``retrying`` or ``failed`` is logged to the ``runlane.task`` logger (a warning while retries
are left, an error once the run failed) with the exception and its traceback, and an abandoned
attempt as a warning.

This module never touches a storage driver directly; it writes through the runtime's store and
batchers.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from ..durations import Duration, format_duration, later
from ..errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error, is_storage_conflict
from ..ids import validate_id
from ..json_values import (
    canonical_json,
    canonical_json_of_checked,
    is_json_value,
    json_value_problem,
    non_finite_float_path,
    shown_path,
)
from ..model_build import build_validated, worker_actor
from ..models import (
    Actor,
    Environment,
    RunCancelledEvent,
    RunEvent,
    RunFailedEvent,
    RunFailure,
    RunLease,
    RunLeaseHeartbeatEvent,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunStepRecord,
    RunSucceededEvent,
    environment_key,
)
from ..storage.batching import Batcher
from ..storage.codecs import encode_iso_date
from ..storage.types import StorageLimitError
from ..vocabulary import ActorType, RunEventType, RunSourceType, RunStatus, RunWaitConditionType, run_status_values
from .authoring import (
    MAX_REPORTED_ERRORS,
    NOT_GIVEN_BACK,
    RetryPolicy,
    TaskDefinition,
    TaskRelease,
    build_run_wait,
    build_signal_wait,
    build_time_release,
    read_back,
    summarize_errors,
    validation_errors,
)
from .cancellation import CancellationController, CancellationSignal, being_cancelled, link_signals
from .store import AppendResult, CompletionRequest, StepCompletion

if TYPE_CHECKING:
    from .runtime import Runlane, TriggerRunResult

T = TypeVar("T")

__all__ = [
    "AttemptResult",
    "CancellationRegistry",
    "ExecutionOptions",
    "RunContextFilter",
    "StepRunner",
    "TaskContext",
    "current_task_context",
    "execute_claimed_run",
    "failure_from_exception",
    "failure_outcome_events",
    "step_token",
]

_CANCELLATION_REQUESTED = RunStatus.CANCELLATION_REQUESTED
_ATTEMPT_OWNERS = frozenset({RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED})
# The events an attempt's outcome writes (``outcome_build``).
_OUTCOME_EVENT_TYPES = frozenset(
    {
        RunEventType.SUCCEEDED,
        RunEventType.FAILED,
        RunEventType.RETRY_SCHEDULED,
        RunEventType.RELEASED,
        RunEventType.CANCELLED,
    }
)

_task_log = logging.getLogger("runlane.task")
_worker_log = logging.getLogger("runlane.worker")
# A heartbeat this late (or half its interval, if that is shorter, but not less than ordinary scheduling
# jitter) means something blocked the loop.
_BLOCKED_LOOP_WARNING_S = 1.0
_LOOP_JITTER_S = 0.05
# Per event loop, the loop time a blocked loop was last reported at (see ``_warn_if_the_loop_was_blocked``).
_blocks_reported: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, float] = weakref.WeakKeyDictionary()
_BLOCKING_CANDIDATES_SHOWN = 5

# Abort reasons the runtime gives ``TaskContext.signal``.
REASON_CANCELLATION_REQUESTED = "cancellation_requested"
REASON_ATTEMPT_TIMED_OUT = "attempt_timed_out"
REASON_LEASE_LOST = "lease_lost"
REASON_HEARTBEAT_FAILED = "heartbeat_failed"
REASON_WORKER_STOPPED = "worker_stopped"  # a worker stop, and closing the runtime: not a cancellation
# How often an attempt reads its run when a driver's hints say only that another process committed.
_CANCELLATION_CHECK_S = 1.0
#: How long an ``async def`` handler may go on after its attempt deadline aborted ``ctx.signal`` before
#: it is cancelled: time for a cooperative handler to return and for cleanup on the signal.
TIMEOUT_GRACE_S = 1.0
# A worker's attempt retries a heartbeat or its outcome write that storage could not take
# (storage_unavailable) after these delays, doubling, while its lease still holds.
_STORAGE_RETRY_START_S = 0.05
_STORAGE_RETRY_MAX_S = 2.0
# How long a drain worker, or a worker told to stop, waits out unavailable storage (seconds).
DRAIN_OUTAGE_LIMIT_S = 30.0
# How often ``CancellationRegistry.stop_all`` looks again for attempts it should no longer wait for (their
# event loop stopped) or that started after it did (seconds).
_STOP_RECHECK_S = 0.5
_STOP_CLAIM_S = 0.005  # how often it looks again while a claim is being written
_STEP_KEYS_LOCK = threading.Lock()  # around ``_Attempt.step_key_lock``'s lookup (def handlers' threads)
# Cancellation notices no attempt of the registry matched, kept for an attempt that registers later (most
# are for attempts of other processes, which never register here: the oldest are dropped past this).
_UNMATCHED_NOTICES = 1024
_NO_NOTICE: Any = object()  # ``register``: no notice was kept for the run

# A run whose attempts keep ending with no outcome (its worker crashed, was killed or lost the lease)
# is failed instead of run again once that many attempts are spent, or its retry budget if larger.
ABANDONED_ATTEMPTS_LIMIT = 3

# Persisted failures carry task-facing text, never the raw exception message (it may hold secrets).
_TASK_FACING_MESSAGES: dict[ErrorCode, str] = {
    ErrorCode.TASK_FAILED: "Task failed.",
    ErrorCode.TASK_TIMED_OUT: "Task timed out.",
    ErrorCode.TASK_OUTPUT_INVALID: "Task output is invalid.",
    ErrorCode.OPERATION_CANCELLED: "Task was cancelled.",
    ErrorCode.TASK_NOT_FOUND: "Task is not registered in this runtime.",
}


def _task_facing_message(code: ErrorCode) -> str:
    return _TASK_FACING_MESSAGES.get(code) or f"Task failed ({code.value})."


# ---------------------------------------------------------------------------------------------
# Options and results


@dataclass(frozen=True, slots=True)
class ExecutionOptions:
    """Resolved execution options of one execution path (validated by the runtime)."""

    lease_ms: int
    heartbeat_ms: int
    max_attempt_ms: int | None
    signal: CancellationSignal | None
    worker_id: str
    # Whether "no due run" must come from reading the whole queue (see ``NextClaimRequest``); a
    # poll worker, which looks again soon anyway, takes it from a scan that starts at the floor.
    confirm_idle: bool = True
    # A worker rides out storage outages: its attempts retry a heartbeat or outcome write that failed
    # with storage_unavailable while their lease holds. execute_next, execute_delivery and run_now
    # report the failure to their caller instead.
    ride_out_outages: bool = False
    # How long such an attempt waits out unavailable storage at most (seconds): a drain worker gives up
    # after DRAIN_OUTAGE_LIMIT_S, as its claim loop does, so a scheduled drain never outlasts an outage
    # by a whole lease; ``None``: while the lease holds. A stopping worker waits at most that long too.
    outage_limit_s: float | None = None
    # A drain worker's outage, shared by its claim loop and its attempts, so that the limit counts from
    # the first failure any of them met: an attempt that gives up its outcome write has spent the
    # drain's wait, not started it. ``None``: each attempt counts from its own first failure.
    outage_clock: OutageClock | None = None


class OutageClock:
    """When (loop time) storage was first found unavailable in the current outage, ``None`` when it is
    not known to be. Used from its event loop's thread only."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def down(self, now: float) -> float:
        """Storage failed at ``now``: the loop time the outage began."""
        if self.since is None:
            self.since = now
        return self.since

    def up(self) -> None:
        """Storage answered: the outage, if any, is over."""
        self.since = None


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """The persisted run after one attempt, or ``abandoned`` (lease lost) with the conflict."""

    run: RunRecord | None
    abandoned: bool = False
    conflict: RunlaneError | None = None


# ---------------------------------------------------------------------------------------------
# Same-process cancellation registry


class CancellationRegistry:
    """Running attempts of this runtime by run id, so ``runs.cancel`` aborts their signal at once, and
    every attempt in flight (from its claim until its outcome is written), so closing the runtime can
    stop them and wait for their outcomes (``stop_all``).

    A notification matches run id, worker id and lease token, so a stale request can never abort a
    later attempt of the same run. Thread-safe: the sync facade cancels from its own loop thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attempts: dict[str, list[_Attempt]] = {}
        # Attempts in flight, each with the future ``stop_all`` waits on (made only once something waits).
        self._in_flight: dict[_Attempt, concurrent.futures.Future[None] | None] = {}
        # Calls (execute_next, run_now, execute_delivery) whose claim is being written, with their loop:
        # an attempt may begin from each, which ``stop_all`` must wait for too.
        self._claiming: dict[object, asyncio.AbstractEventLoop] = {}
        self._stop_reason: str | None = None  # set by ``stop_all``: attempts that begin later stop at once
        # Run id -> the (worker id, lease token) a cancellation named, or ``None`` for another process's
        # hint, when no registered attempt matched: an attempt claimed before the request committed may
        # not be registered yet (its claim's commit is awaited, then observed), and picks it up then.
        self._unmatched: collections.OrderedDict[str, tuple[str, str] | None] = collections.OrderedDict()

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Around a call that claims a run and executes it: until its attempt begins (or no run was
        claimed), closing the runtime waits, so an attempt claimed meanwhile is not left to a closed lane."""
        token = object()
        with self._lock:
            self._claiming[token] = asyncio.get_running_loop()
        scope = _claim_in_flight.set(token)
        try:
            yield
        finally:
            _claim_in_flight.reset(scope)
            self._claimed(token)

    def _claimed(self, token: object | None) -> None:
        if token is not None:
            with self._lock:
                self._claiming.pop(token, None)

    def begin(self, attempt: _Attempt) -> None:
        with self._lock:
            self._in_flight[attempt] = None
            reason = self._stop_reason
        self._claimed(_claim_in_flight.get())  # the claim's attempt has begun: it is waited for as such
        if reason is not None:  # claimed while the runtime was closing
            attempt.stop(reason)

    def async_handlers_on(self, loop: asyncio.AbstractEventLoop) -> list[_Attempt]:
        """The attempts in flight on ``loop`` whose handler is an ``async def``: the ones that can block it."""
        with self._lock:
            attempts = list(self._in_flight)
        return [
            attempt
            for attempt in attempts
            if attempt.loop is loop and attempt.definition is not None and attempt.definition.is_async
        ]

    def end(self, attempt: _Attempt) -> None:
        with self._lock:
            waiter = self._in_flight.pop(attempt, None)
        if waiter is not None:
            waiter.set_result(None)

    async def stop_all(self, reason: str) -> None:
        """Abort the signal of every attempt in flight with ``reason``, as a worker stop does (not a
        cancellation), and wait until each has finished and written its outcome; an attempt that begins
        meanwhile is stopped at once and waited for too. Not waited for: attempts whose event loop no
        longer runs (they cannot finish), and the attempt whose task calls this (it would wait for itself)."""
        own = _current_attempt.get()
        if own is not None and not own.handler_is_caller():
            own = None  # a task its handler started: the attempt is stopped and waited for like any other
        own_claim = _claim_in_flight.get()
        with self._lock:
            self._stop_reason = reason
        while True:
            waiting: list[tuple[_Attempt, concurrent.futures.Future[None]]] = []
            with self._lock:
                for attempt, waiter in list(self._in_flight.items()):
                    if attempt is own or not attempt.loop.is_running():
                        continue
                    if waiter is None:
                        waiter = self._in_flight[attempt] = concurrent.futures.Future()
                    waiting.append((attempt, waiter))
                claims = any(token is not own_claim and loop.is_running() for token, loop in self._claiming.items())
            if not waiting and not claims:
                return
            for attempt, _waiter in waiting:
                attempt.stop(reason)
            if waiting:
                wrapped = [asyncio.wrap_future(waiter) for _attempt, waiter in waiting]
                await asyncio.wait(wrapped, timeout=_STOP_CLAIM_S if claims else _STOP_RECHECK_S)
            else:  # a claim is being written: its attempt begins (stopped at once) or no run was claimed
                await asyncio.sleep(_STOP_CLAIM_S)

    def stop_on(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        """Abort, with ``reason``, the signal of every attempt in flight on ``loop``, without waiting for them
        and with no effect on attempts that begin later (the ``runlane.sync`` facade's loop, as the process
        exits: the threads of ``def`` handlers are joined next, before the runtime closes)."""
        with self._lock:
            attempts = [attempt for attempt in self._in_flight if attempt.loop is loop]
        for attempt in attempts:
            attempt.stop(reason)

    def signal_waits(self) -> dict[tuple[int, int], datetime | None]:
        """The attempts in flight whose handler waits for its signal, where nothing else may end the wait:
        on a clock moved by hand (``run_until_idle``) only moving it to the attempt's deadline does. Keyed
        by the wait (the attempt, and the count of waits its handler began: a handler that waits again and
        again, a short while each time, shows new keys), each with the attempt's deadline, or ``None``
        without one (no ``max_attempt_duration``: nothing in the process will end the wait)."""
        with self._lock:
            attempts = list(self._in_flight)
        waits: dict[tuple[int, int], datetime | None] = {}
        for attempt in attempts:
            signal = attempt.controller.signal
            serial = None if signal.aborted else signal._waited_on()
            if serial is not None:
                waits[(id(attempt), serial)] = attempt.run.attempt_deadline_at
        return waits

    def register(self, attempt: _Attempt) -> None:
        with self._lock:
            self._attempts.setdefault(attempt.run_id, []).append(attempt)
            if not self._unmatched:
                return
            missed = self._unmatched.pop(attempt.run_id, _NO_NOTICE)
        if missed is None:
            attempt.check_cancellation_soon()  # a hint, not trusted: read the run
        elif missed == (attempt.worker_id, attempt.token):
            attempt.observe_cancellation()

    def _note_unmatched(self, run_id: str, notice: tuple[str, str] | None) -> None:
        with self._lock:
            if notice is None and self._unmatched.get(run_id) is not None:
                return  # a same-process request for the run says more than a hint
            self._unmatched[run_id] = notice
            self._unmatched.move_to_end(run_id)
            while len(self._unmatched) > _UNMATCHED_NOTICES:
                self._unmatched.popitem(last=False)

    def unregister(self, attempt: _Attempt) -> None:
        with self._lock:
            entries = self._attempts.get(attempt.run_id)
            if entries is None:
                return
            try:
                entries.remove(attempt)
            except ValueError:
                return
            if not entries:
                del self._attempts[attempt.run_id]

    def notify_cancellation(self, run_id: str, worker_id: str, lease_token: str) -> bool:
        """Abort the signal of the matching running attempt; ``True`` when one was found."""
        with self._lock:
            matches = [
                attempt
                for attempt in self._attempts.get(run_id, ())
                if attempt.worker_id == worker_id and attempt.token == lease_token
            ]
        for attempt in matches:
            attempt.observe_cancellation()
        if not matches:
            self._note_unmatched(run_id, (worker_id, lease_token))
        return bool(matches)

    def holds(self, run_id: str, lease_token: str) -> bool:
        """Whether an attempt of this runtime runs ``run_id`` under ``lease_token``. Such an attempt is
        alive, so a lease it holds that looks expired means this process's clock stepped forward past
        the lease: the attempt heartbeats now, renewing the lease on the new time, and no claim or
        recovery of this process may take the run from it meanwhile. An attempt whose handler ignores a
        cancellation or its deadline for longer than it is given (``given_up``) holds nothing: its
        process's own maintenance finalizes it, as the spec has any process's do. From any thread."""
        with self._lock:
            attempts = [attempt for attempt in self._attempts.get(run_id, ()) if attempt.token == lease_token]
        attempts = [attempt for attempt in attempts if not attempt.given_up()]
        for attempt in attempts:
            attempt.heartbeat_soon()
        return bool(attempts)

    def check_now(self, run_id: str) -> bool:
        """Heartbeat this process's attempts of ``run_id`` now instead of at their next interval: another
        process requested cancellation of the run, and a heartbeat is how an attempt observes that from
        storage (the request itself is not trusted). ``True`` when there was one. From any thread."""
        with self._lock:
            attempts = list(self._attempts.get(run_id, ()))
        for attempt in attempts:
            attempt.heartbeat_soon()
        if not attempts:
            self._note_unmatched(run_id, None)
        return bool(attempts)

    def check_all_soon(self) -> None:
        """Another process committed something, and the driver's hints cannot say what: each running
        attempt reads its run (at most once a second) to see whether cancellation was requested."""
        with self._lock:
            attempts = [attempt for entries in self._attempts.values() for attempt in entries]
        for attempt in attempts:
            attempt.check_cancellation_soon()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._attempts.values())


# ---------------------------------------------------------------------------------------------
# Outcome events (pure functions of the stored run and the transaction time)


def timed_out_failure() -> RunFailure:
    """The failure of an attempt that passed its ``max_attempt_duration`` deadline."""
    return RunFailure(code=ErrorCode.TASK_TIMED_OUT, message="Task timed out.", retryable=True)


def _raised(error: BaseException) -> list[BaseException]:
    """The exceptions ``error`` stands for: those an exception group holds (nested groups flattened),
    else ``error`` itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _raised(inner)]
    return [error]


def failure_from_exception(error: BaseException) -> RunFailure:
    """The persisted failure for an exception raised by task code. A ``RunlaneError`` task code has
    tampered with (a ``code`` that is no error code, ``meta`` that is no JSON object) is an unknown error.
    An exception group of one exception (an ``asyncio.TaskGroup`` one of whose tasks failed) is that one."""
    raised = _raised(error)
    if len(raised) == 1 and raised[0] is not error:
        return failure_from_exception(raised[0])
    if isinstance(error, _StepOutputDrift):
        return error.failure
    if isinstance(error, RunlaneError):
        try:
            code = ErrorCode(error.code)
            meta = error.meta if isinstance(error.meta, dict) and is_json_value(error.meta) else {}
            return RunFailure(
                code=code,
                message=_task_facing_message(code),
                retryable=error.retryable is True,
                meta=json.loads(canonical_json(meta)) if meta else {},
            )
        except (ValueError, TypeError, ValidationError):  # noqa: S110 - recorded as an unknown error below
            pass
    if isinstance(error, BaseExceptionGroup):
        # asyncio.TaskGroup's: a RunlaneError in it that says not to retry is not retried either.
        final = error.subgroup(lambda raised: isinstance(raised, RunlaneError) and raised.retryable is not True)
        if final is not None:
            return RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.", retryable=False)
    return RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.", retryable=True)


def _signal_abort_failure(error: BaseException) -> RunFailure | None:
    """The failure of the non-retryable ``operation_cancelled`` that task code raises when its signal is
    aborted (``ctx.signal.raise_if_aborted()``): raised as such, or by every task of an
    ``asyncio.TaskGroup`` that failed (an exception group holding nothing else). ``None`` otherwise."""
    failures = [failure_from_exception(raised) for raised in _raised(error)]
    if all(failure.code is ErrorCode.OPERATION_CANCELLED and not failure.retryable for failure in failures):
        return failures[0]
    return None


def failure_outcome_events(
    run: RunRecord,
    at: datetime,
    failure: RunFailure,
    retry: RetryPolicy | None,
    actor: Actor,
    *,
    allow_retry: bool,
) -> list[RunEvent]:
    """``run.retry_scheduled`` when the failure is retryable and budget is left, else ``run.failed``.

    No retry once cancellation was requested. Attempts that ended in a release (business waiting,
    wait timeouts included) spend none of the retry budget: ``max_attempts`` and the backoff count the
    attempts that did not.
    """
    attempt = run.counters.attempts
    spent = attempt - run.counters.releases
    if (
        allow_retry
        and failure.retryable
        and retry is not None
        and spent < retry.max_attempts
        and run.status is not _CANCELLATION_REQUESTED
    ):
        delay_ms = retry.delay_ms_for(spent)
        return [
            RunRetryScheduledEvent(
                run_id=run.id,
                environment=run.environment,
                occurred_at=at,
                actor=actor,
                attempt=attempt,
                failure=failure,
                delay=format_duration(delay_ms),
                retry_at=later(at, delay_ms),
            )
        ]
    return [RunFailedEvent(run_id=run.id, environment=run.environment, occurred_at=at, actor=actor, attempt=attempt, failure=failure)]


def _refuse_waiting_for_itself(release: TaskRelease, run_id: str) -> None:
    """A run cannot wait for its own completion: it is not terminal while it waits, so nothing would
    ever resume it."""
    if release.wait_type is RunWaitConditionType.RUN_COMPLETION and release.run_id == run_id:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            "A run cannot wait for its own completion; wait for another run's id.",
            meta={"field": "run_id"},
        )


def _release_events(run: RunRecord, at: datetime, release: TaskRelease, actor: Actor) -> list[RunEvent]:
    common: dict[str, Any] = dict(
        run_id=run.id, environment=run.environment, occurred_at=at, actor=actor, attempt=run.counters.attempts,
        reason=release.reason, meta=release.meta,
    )
    if release.wait_type is RunWaitConditionType.TIME:
        assert release.delay_ms is not None
        return [
            RunReleasedEvent(
                **common, delay=format_duration(release.delay_ms), resume_at=later(at, release.delay_ms)
            )
        ]
    return [RunReleasedEvent(**common, wait=release.wait_condition(at))]


_NOT_READ: Any = object()  # ``check_live`` without a stored run to check against


# What a handler that raised on its worker's stop (``ctx.signal.raise_if_aborted()``) leaves behind: the
# run, released, is due again at once (a release needs a positive delay).
_STOPPED_WITH_THE_WORKER = TaskRelease(wait_type=RunWaitConditionType.TIME, delay_ms=1, reason=REASON_WORKER_STOPPED)

# The three shapes a finished handler leaves behind.
_SUCCESS = 0
_RELEASE = 1
_FAILURE = 2


@dataclass(frozen=True, slots=True)
class _Outcome:
    kind: int
    output: Any = None
    has_output: bool = False
    release: TaskRelease | None = None
    failure: RunFailure | None = None
    error: BaseException | None = None  # what the handler raised, for the process log only


_VOID_SUCCESS = _Outcome(_SUCCESS)


def _outcome_for_result(result: Any) -> _Outcome:
    if result is None:
        return _VOID_SUCCESS
    if isinstance(result, TaskRelease):
        return _Outcome(_RELEASE, release=result)
    if isinstance(result, dict) and result.get("type") == "task_release":
        return _Outcome(
            _FAILURE,
            failure=RunFailure(
                code=ErrorCode.TASK_OUTPUT_INVALID,
                message="Task output uses the reserved type 'task_release'; return ctx.release(...) to release the run.",
                retryable=True,
            ),
        )
    problem = json_value_problem(result)
    if problem is not None:
        # Where and what (a key path and a type name), never the value itself.
        where, reason, found = problem
        path = shown_path(where)
        if isinstance(found, TaskRelease):
            message = (
                f"Task output holds a release at {path}; return the release itself "
                "(return ctx.wait_for_signal(...), ctx.wait_for_run(...) or ctx.release(...)) to release the run."
            )
        else:
            message = f"Task output is not JSON-compatible: {reason} at {path}."
        return _Outcome(
            _FAILURE,
            failure=RunFailure(
                code=ErrorCode.TASK_OUTPUT_INVALID,
                message=message,
                retryable=True,
                meta={"output_type": type(result).__name__, "path": path},
            ),
        )
    # Stored and returned in its JSON form (tuples as lists, str enums as str), and never shared with
    # the handler: the run an execution path returns must equal the run stored.
    return _Outcome(_SUCCESS, output=json.loads(canonical_json_of_checked(result)), has_output=True)


class HandlerExit(Exception):
    """A handler called ``sys.exit()`` off the main thread (a ``def`` handler's thread, or an ``async def``
    handler on the loop of ``runlane.sync``): there it ends only that thread, so it fails the attempt like
    any other exception instead of stopping the worker's event loop."""


class _ThreadGate:
    """Holds a ``def`` handler's call until its submission to the handler threads is known to have
    succeeded. ``ThreadPoolExecutor.submit`` queues the call before it starts a thread for it, so when
    starting the thread fails (a limit on threads) the call stays queued and a thread that frees up would
    run the handler of an attempt already given up on; a closed gate makes that call do nothing."""

    __slots__ = ("_decided", "_open")

    def __init__(self) -> None:
        self._decided = threading.Event()
        self._open = False

    def open(self) -> None:
        self._open = True
        self._decided.set()

    def close(self) -> None:
        self._decided.set()

    def run(self, call: Callable[..., Any], *args: Any) -> Any:
        self._decided.wait()
        return call(*args) if self._open else None


# The release of an attempt whose def handler got no thread: again after a pause, not at once, so a
# process at its thread limit does not claim and release the same runs in a loop.
_NO_HANDLER_THREAD_MS = 5_000
_NO_HANDLER_THREAD = TaskRelease(
    wait_type=RunWaitConditionType.TIME, delay_ms=_NO_HANDLER_THREAD_MS, reason="handler_thread_unavailable"
)


def _interpreter_exiting(error: BaseException) -> bool:
    """Whether a ``def`` handler got no thread because the interpreter is exiting: ``concurrent.futures``
    refuses new work once its exit hook has run, and its module, first imported that late, cannot even
    register that hook ("can't register atexit after shutdown")."""
    if sys.is_finalizing():
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and ("interpreter shutdown" in message or "atexit after shutdown" in message)


def _handler_exit(error: SystemExit) -> HandlerExit:
    exit_error = HandlerExit(f"The handler called sys.exit({error.code!r}).")
    exit_error.__cause__ = error
    return exit_error


def _call_in_thread(handler: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    try:
        return handler(*args)
    except SystemExit as error:
        raise _handler_exit(error) from error


_STORE_LARGE_DATA_ELSEWHERE = " Store large data elsewhere and return a reference to it."


def _oversized_outcome_failure(outcome: _Outcome, error: StorageLimitError) -> RunFailure:
    """The failure stored for an outcome whose records exceed a storage limit of the lane: the same
    failure without its meta when that is what was large, else ``task_output_invalid``."""
    limit = {"storage_limit": error.limit, "limit": error.allowed, "actual": error.actual}
    failure = outcome.failure
    if failure is not None and failure.meta:
        return failure.model_copy(update={"meta": {"meta_dropped": "too large to store", **limit}})
    what = "Task output" if outcome.kind == _SUCCESS else "The attempt's outcome"
    return RunFailure(
        code=ErrorCode.TASK_OUTPUT_INVALID,
        message=error.too_large(what, _STORE_LARGE_DATA_ELSEWHERE),
        retryable=True,
        meta=limit,
    )


def _log_fields(run: RunRecord, code: ErrorCode | None = None) -> dict[str, Any]:
    """The structured fields of an attempt's log record (``extra=``), for handlers that keep them."""
    fields: dict[str, Any] = {"run_id": run.id, "task_id": run.task_id, "attempt": run.counters.attempts}
    if code is not None:
        fields["error_code"] = code.value
    return fields


_RUNTIME_FRAMES = (
    str(Path(__file__).resolve().parent.parent) + os.sep,  # runlane: the attempt path that called the handler
    str(Path(threading.__file__).resolve().parent / "concurrent") + os.sep,  # the handler thread pool
)


def _from_the_handler(error: BaseException | None) -> tuple[type[BaseException], BaseException, Any] | None:
    """``exc_info`` for ``error`` with the runtime's own frames above the handler left out, so a logged
    traceback starts at the handler's line (frames below it, in any library, are all kept)."""
    if error is None:
        return None
    frames = error.__traceback__
    while frames is not None and frames.tb_next is not None:
        if not str(Path(frames.tb_frame.f_code.co_filename).resolve()).startswith(_RUNTIME_FRAMES):
            break
        frames = frames.tb_next
    return type(error), error, frames


def _log_failed_attempt(run: RunRecord, outcome: _Outcome) -> None:
    """Log an attempt whose stored outcome is ``retrying`` or ``failed``, with the handler's exception
    when that is what the stored failure came from (not a timeout or cancellation that overtook it)."""
    status = run.status
    if status is RunStatus.RETRYING:
        # A retrying run is due again at ``run_at``.
        retry_at = cast(datetime, run.run_at).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        level, then = logging.WARNING, f"retry at {retry_at}"
    elif status is RunStatus.FAILED:
        level, then = logging.ERROR, "the run has failed"
    else:
        return
    failure = run.failure
    if failure is None or not _task_log.isEnabledFor(level):
        return
    error = outcome.error
    if outcome.failure is None or outcome.failure.code is not failure.code:
        error = None
    _task_log.log(
        level,
        "Run %s (task %s): attempt %d failed with %s (%s); %s.",
        run.id, run.task_id, run.counters.attempts, failure.code.value, failure.message, then,
        exc_info=_from_the_handler(error),
        extra=_log_fields(run, failure.code),
    )  # fmt: skip


def log_timed_out_attempt(run: RunRecord) -> None:
    """Log the attempt whose timeout maintenance recorded in ``run`` (now ``retrying`` or ``failed``)."""
    _log_failed_attempt(run, _Outcome(_FAILURE, failure=timed_out_failure()))


# ---------------------------------------------------------------------------------------------
# Steps


def step_token(environment: Environment, run_id: str, step_key: str) -> str:
    """The deterministic token of one step: the same for ``environment + run id + step key`` forever."""
    text = canonical_json([environment_key(environment), run_id, step_key])
    return "step_" + hashlib.sha256(text.encode("utf-8")).hexdigest()


_OUTPUT_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}
_OUTPUT_ADAPTERS_LOCK = threading.Lock()


def _output_adapter(output: Any) -> TypeAdapter[Any] | None:
    if output is None:
        return None
    try:
        cached = _OUTPUT_ADAPTERS.get(output)
    except TypeError:  # unhashable type expressions are rebuilt each time
        cached = None
    if cached is not None:
        return cached
    try:
        adapter: TypeAdapter[Any] = TypeAdapter(output)
        # A string or forward reference is only resolved on first use, after fn has run: resolve it now, so
        # a schema that cannot be used fails before fn's side effect (and is not retried), as a payload's does.
        if not getattr(adapter, "pydantic_complete", True):
            adapter.rebuild(raise_errors=True)
    except Exception as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"step output schema {output!r} is not a type pydantic can validate ({detail}); "
            "pass a pydantic model class or a type pydantic.TypeAdapter accepts.",
            meta={"field": "output"},
        ) from None
    try:
        with _OUTPUT_ADAPTERS_LOCK:
            _OUTPUT_ADAPTERS[output] = adapter
    except TypeError:
        pass
    return adapter


def _parse_step_output(step_key: str, value: Any, adapter: TypeAdapter[Any] | None) -> tuple[Any, Any]:
    """``(returned, stored)``: what ``step.run`` returns and the JSON value persisted for the step."""
    if adapter is None:
        invalid = json_value_problem(value)
        if invalid is not None:
            where, reason, _ = invalid
            where = shown_path(where)
            raise RunlaneError(
                ErrorCode.TASK_OUTPUT_INVALID,
                f"Step {step_key!r} returned a value that is not JSON-compatible ({reason} at {where}); "
                "return a small JSON value such as {'job_id': ...}.",
                retryable=True,
                meta={"step_key": step_key, "path": where},
            )
        stored = json.loads(canonical_json(value))
        return stored, stored
    try:
        parsed = adapter.validate_python(value)
        path = non_finite_float_path(parsed)
        if path is not None:
            raise RunlaneError(
                ErrorCode.TASK_OUTPUT_INVALID,
                f"Step {step_key!r} returned a NaN or infinite number at {path}, which JSON cannot hold.",
                retryable=True,
                meta={"step_key": step_key, "path": path},
            )
        stored = adapter.dump_python(parsed, mode="json", by_alias=True)  # by alias: what the schema reads back
    except ValidationError as error:
        # Where and what, as for a payload ("job_id: Input should be a valid integer"): pydantic's first line
        # ("2 validation errors for Submission") names neither. The errors in meta keep no value.
        errors, summary = validation_errors(error, whole="output")
        raise RunlaneError(
            ErrorCode.TASK_OUTPUT_INVALID,
            f"Step {step_key!r} returned output that does not match its output schema: {summary}.",
            retryable=True,
            meta={"step_key": step_key, "error_count": len(errors), "errors": errors[:MAX_REPORTED_ERRORS]},
        ) from None
    except (ValueError, RecursionError, PydanticSerializationError) as error:
        # Besides validation: bytes that are not UTF-8, or pydantic's "Maximum serialization depth exceeded".
        problem = (
            "does not match its output schema"
            if isinstance(error, PydanticSerializationError)
            else "cannot be stored as JSON"
        )
        raise RunlaneError(
            ErrorCode.TASK_OUTPUT_INVALID,
            f"Step {step_key!r} returned output that {problem}: {str(error).splitlines()[0]}.",
            retryable=True,
            meta={"step_key": step_key},
        ) from None
    if not is_json_value(stored):
        raise RunlaneError(
            ErrorCode.TASK_OUTPUT_INVALID,
            f"Step {step_key!r} output cannot be stored as JSON.",
            retryable=True,
            meta={"step_key": step_key},
        )
    # Later attempts parse the stored output again, and must get what this attempt got.
    again = read_back(adapter, parsed, stored)
    if again is NOT_GIVEN_BACK:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The output schema of step {step_key!r} does not give back its own output: parsing the stored "
            f"{canonical_json(stored)[:200]} gives another value, so later attempts would not see what this one "
            "did. Make the schema's transforms idempotent, or apply a one-way transform after step.run().",
            meta={"step_key": step_key},
        )
    return again, stored


class _StepOutputDrift(RunlaneError):
    """``validation_failed``: the stored output of a step no longer matches its ``output=`` schema (a deploy
    changed the schema after the step ran). Raised by the runtime, not written by task code, so a run it
    fails stores its message and errors (``failure``), not the generic text that stands in for task code's
    messages: they come from the schema and the step key, never from the stored values."""

    def __init__(self, failure: RunFailure) -> None:
        super().__init__(failure.code, failure.message, meta=failure.meta)
        self.failure = failure


def _step_output_drift(step_key: str, error: Exception) -> _StepOutputDrift:
    meta: dict[str, Any] = {"step_key": step_key}
    if isinstance(error, ValidationError):
        errors, _quoting = validation_errors(error)  # that summary may quote the stored value: not persisted
        summary = summarize_errors(errors, whole="output")  # of the persistable errors
    else:  # a validator's own TypeError, KeyError...: its text may quote the value too
        errors, summary = [], f"its validation raised {type(error).__name__}"
        meta["error_type"] = type(error).__name__
    return _StepOutputDrift(
        RunFailure(
            code=ErrorCode.VALIDATION_FAILED,
            message=(
                f"The stored output of step {step_key!r} no longer matches its output schema: {summary}. It was "
                "stored under an earlier schema: change a step's schema so that it still reads what runs in flight "
                "stored (new fields optional or with defaults). A retry of this run is a new run, which calls the "
                "step again."
            ),
            retryable=False,
            meta={**meta, "error_count": len(errors), "errors": errors[:MAX_REPORTED_ERRORS]},
        )
    )


def _load_step_output(step_key: str, stored: Any, adapter: TypeAdapter[Any] | None) -> Any:
    if adapter is None:
        return stored
    try:
        return adapter.validate_json(canonical_json(stored))
    except ValidationError as error:
        raise _step_output_drift(step_key, error) from None
    except Exception as error:  # pydantic turns only a validator's ValueError and AssertionError into errors
        raise _step_output_drift(step_key, error) from error


class StepRunner:
    """``ctx.step``: ``run(step_key, fn, *, output=None)`` checkpoints ``fn(token)``'s result once per run."""

    __slots__ = ("_attempt",)

    def __init__(self, attempt: _Attempt) -> None:
        self._attempt = attempt

    def run(self, step_key: str, fn: Callable[[str], Any], *, output: Any = None) -> Any:
        """Return the stored output of ``step_key``, or call ``fn(token)``, store its output and return it.

        An awaitable in ``async def`` handlers; a blocking call in ``def`` handlers.
        """
        key = validate_id(step_key, "step key")
        if not callable(fn):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"step.run() needs a function, got {fn!r}.")
        adapter = _output_adapter(output)
        attempt = self._attempt
        if attempt.on_loop_thread():
            return attempt.handed_out(self._run_async(key, fn, adapter), f"ctx.step.run({key!r})")
        return self._run_blocking(key, fn, adapter)

    async def _run_async(self, key: str, fn: Callable[[str], Any], adapter: TypeAdapter[Any] | None) -> Any:
        with self._attempt.step_running():
            return await self._run_step(key, fn, adapter)

    async def _run_step(self, key: str, fn: Callable[[str], Any], adapter: TypeAdapter[Any] | None) -> Any:
        # One call of a key at a time: a second one (side by side in asyncio.gather) waits, then reads what
        # the first stored instead of calling its fn again.
        attempt = self._attempt
        lock = attempt.step_key_lock(key, asyncio.current_task())
        async with lock:
            with attempt.step_key_held(key, asyncio.current_task()):
                return await self._run_step_alone(key, fn, adapter)

    async def _run_step_alone(self, key: str, fn: Callable[[str], Any], adapter: TypeAdapter[Any] | None) -> Any:
        attempt = self._attempt
        store = attempt.runtime.store
        what = f"step {key!r}"
        existing, run = await attempt.riding_out(lambda: store.get_step_with_run(attempt.run_id, key), what)
        if existing is not None:
            return _load_step_output(key, existing.output, adapter)
        attempt.check_live("ctx.step.run()", run)  # before fn: its side effects would be for a finished attempt
        token = step_token(attempt.runtime.environment, attempt.run_id, key)
        value = fn(token)
        if inspect.isawaitable(value):
            value = await value
        returned, stored = _parse_step_output(key, value, adapter)
        await attempt.storing_step(attempt.riding_out(lambda: attempt.complete_step(key, token, stored), what))
        return returned

    def _run_blocking(self, key: str, fn: Callable[[str], Any], adapter: TypeAdapter[Any] | None) -> Any:
        # A def handler's threads, or a thread an async def handler gave work to: the key's lock is taken on the
        # attempt's loop, so that calls of the key there (awaited) and in threads wait for one another.
        attempt = self._attempt
        caller = threading.get_ident()
        lock = attempt.step_key_lock(key, caller)
        attempt.call_on_loop(lock.acquire(), "ctx.step.run()")
        try:
            with attempt.step_key_held(key, caller):
                return self._run_blocking_alone(key, fn, adapter)
        finally:
            with contextlib.suppress(RuntimeError):  # the attempt's loop has closed: nothing waits for the key
                attempt.loop.call_soon_threadsafe(lock.release)

    def _run_blocking_alone(self, key: str, fn: Callable[[str], Any], adapter: TypeAdapter[Any] | None) -> Any:
        attempt = self._attempt
        store = attempt.runtime.store
        what = f"step {key!r}"
        existing, run = attempt.call_on_loop(
            attempt.riding_out(lambda: store.get_step_with_run(attempt.run_id, key), what), "ctx.step.run()"
        )
        if existing is not None:
            return _load_step_output(key, existing.output, adapter)
        attempt.check_live("ctx.step.run()", run)  # before fn: its side effects would be for a finished attempt
        token = step_token(attempt.runtime.environment, attempt.run_id, key)
        value = fn(token)
        if inspect.isawaitable(value):
            value = attempt.call_on_loop(_awaited(value), "ctx.step.run()")
        returned, stored = _parse_step_output(key, value, adapter)
        attempt.call_on_loop(
            attempt.riding_out(lambda: attempt.complete_step(key, token, stored), what), "ctx.step.run()"
        )
        return returned


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value


# ---------------------------------------------------------------------------------------------
# TaskContext


class TaskContext:
    """What a handler sees of its run: identity, the cancellation signal, release helpers, child
    triggers and durable steps.

    ``trigger``, ``get_run`` and ``step.run`` are awaitables in ``async def`` handlers and blocking
    calls in ``def`` handlers (which run in a worker thread).
    """

    __slots__ = ("_attempt", "step")

    def __init__(self, attempt: _Attempt) -> None:
        self._attempt = attempt
        self.step = StepRunner(attempt)

    def __repr__(self) -> str:
        return f"TaskContext(run_id={self.run_id!r}, task_id={self.task_id!r}, attempt={self.attempt})"

    @property
    def run_id(self) -> str:
        return self._attempt.run_id

    @property
    def task_id(self) -> str:
        return self._attempt.run.task_id

    @property
    def attempt(self) -> int:
        return self._attempt.attempt_number

    @property
    def queue(self) -> str:
        return self._attempt.run.queue

    @property
    def environment(self) -> Environment:
        return self._attempt.run.environment

    @property
    def trace_carrier(self) -> dict[str, str] | None:
        carrier = self._attempt.run.trace_carrier
        return None if carrier is None else dict(carrier)

    @property
    def meta(self) -> dict[str, Any] | None:
        """The run's ``meta`` as its trigger gave it (a copy), or ``None``."""
        meta = self._attempt.run.meta
        return None if meta is None else json.loads(canonical_json(meta))

    @property
    def created_at(self) -> datetime:
        """When the run was created: how long it has waited and retried, for a task that gives up on work
        that has gone stale (compare with ``ctx.now()``)."""
        return self._attempt.run.created_at

    def now(self) -> datetime:
        """The time by the runtime's clock (``create_runlane(clock=...)``, else the system clock), in UTC:
        the time core decides with, so a test's ``ControlledClock`` moves the handler's own time decisions
        too, where ``datetime.now()`` would read the real time."""
        return self._attempt.runtime.now()

    @property
    def source(self) -> RunSource | None:
        """What created the run: a parent run (``ctx.trigger``), a schedule, a rerun or retry; ``None`` for a
        plain trigger."""
        return self._attempt.run.source

    @property
    def signal(self) -> CancellationSignal:
        return self._attempt.controller.signal

    def is_cancellation_requested(self) -> bool:
        """Whether this attempt should stop: cancellation, its deadline, a worker stop or a caller abort."""
        return self._attempt.controller.signal.aborted

    def release(self, delay: Duration, *, reason: str | None = None, meta: dict[str, Any] | None = None) -> TaskRelease:
        """Return this from the handler to release the run until ``delay`` has passed."""
        return build_time_release(delay, reason=reason, meta=meta)

    def wait_for_signal(
        self,
        signal_key: str,
        *,
        timeout: Duration | None = None,
        reason: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> TaskRelease:
        """Return this to release the run until ``runlane.signals.send(signal_key)`` (or ``timeout``)."""
        return build_signal_wait(signal_key, timeout=timeout, reason=reason, meta=meta)

    def wait_for_run(
        self,
        run_id: str,
        *,
        timeout: Duration | None = None,
        reason: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> TaskRelease:
        """Return this to release the run until run ``run_id`` is terminal (or ``timeout``)."""
        release = build_run_wait(run_id, timeout=timeout, reason=reason, meta=meta)
        _refuse_waiting_for_itself(release, self.run_id)
        return release

    def trigger(self, task: Any, payload: Any = None, **options: Any) -> Any:
        """Trigger a child run linked to this one (``source.type = trigger``).

        Takes ``runlane.trigger``'s options; the child inherits this run's trace carrier unless
        ``trace_carrier`` is given. Returns a ``TriggerRunResult`` (awaitable in ``async def`` handlers).
        """
        attempt = self._attempt
        # Through a short storage outage, as steps are (a retry of the handler would trigger again anyway).
        coroutine = attempt.riding_out(lambda: attempt.trigger_child(task, payload, options), "child trigger")
        if attempt.on_loop_thread():
            return attempt.handed_out(coroutine, f"ctx.trigger({getattr(task, 'id', task)!r})")
        return attempt.call_on_loop(coroutine, "ctx.trigger()")

    def get_run(self, run_id: str) -> Any:
        """The current ``RunRecord`` of run ``run_id`` in this run's environment (a child this handler
        triggered, say, to read its output once ``wait_for_run`` resumed this run), or ``None`` when it
        does not exist or was pruned. Awaitable in ``async def`` handlers, blocking in ``def`` handlers.
        An invalid id is ``validation_failed``."""
        attempt = self._attempt
        checked = validate_id(run_id, "run id", code=ErrorCode.VALIDATION_FAILED)
        # No closed check: a closing runtime lets running attempts finish, reads included.
        coroutine = attempt.riding_out(lambda: attempt.runtime.store.get_visible_run(checked), "run read")
        if attempt.on_loop_thread():
            return attempt.handed_out(coroutine, f"ctx.get_run({checked!r})")
        return attempt.call_on_loop(coroutine, "ctx.get_run()")


# ---------------------------------------------------------------------------------------------
# One attempt


class _Attempt:
    """The working state of one claimed attempt: timers, signal, fencing token and outcome."""

    __slots__ = (
        "runtime",
        "run",
        "run_id",
        "definition",
        "options",
        "token",
        "worker_id",
        "attempt_number",
        "loop",
        "loop_thread",
        "controller",
        "timed_out",
        "_timed_out_at",
        "cancel_observed",
        "lost",
        "heartbeat_error",
        "_heartbeat_handle",
        "_heartbeat_due_at",
        "_heartbeat_task",
        "_deadline_handle",
        "_finished",
        "_cancellation_checked_at",
        "_cancellation_check",
        "_cancellation_check_deferred",
        "_handler_task",
        "_handler_runner",
        "_handler_cancelled",
        "_unwatch_clock",
        "_heartbeat_clock_due",
        "_lease_expires_at",
        "_lease_renewed_at",
        "_storage_retry_s",
        "_storage_down_since",
        "_calls",
        "_steps",
        "_steps_running",
        "_step_key_locks",
        "_step_key_holders",
        "_task_context",
    )

    def __init__(self, runtime: Runlane, run: RunRecord, definition: TaskDefinition | None, options: ExecutionOptions) -> None:
        lease = run.lease
        assert lease is not None, "an attempt needs a claimed lease"
        self.runtime = runtime
        self.run = run
        self.run_id = run.id
        self.definition = definition
        self.options = options
        self.token = lease.token
        self.worker_id = lease.worker_id
        self.attempt_number = run.counters.attempts
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.controller: CancellationController = (
            link_signals(options.signal) if options.signal is not None else CancellationController()
        )
        self.timed_out = False
        self._timed_out_at = 0.0  # loop time the deadline was reached
        self.cancel_observed = False
        self.lost: RunlaneError | None = None
        self.heartbeat_error: BaseException | None = None
        self._heartbeat_handle: asyncio.TimerHandle | None = None
        self._heartbeat_due_at = 0.0  # loop time the next heartbeat is due
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._finished = False
        self._cancellation_checked_at = -_CANCELLATION_CHECK_S
        self._cancellation_check: asyncio.Task[None] | None = None  # held so the task is not collected
        self._cancellation_check_deferred = False
        self._handler_task: asyncio.Future[Any] | None = None  # an async def handler's, to cancel at its deadline
        self._handler_runner: asyncio.Future[Any] | None = None  # the task that runs (or awaits) the handler
        self._handler_cancelled = False
        self._unwatch_clock: Callable[[], None] | None = None
        # On a clock moved by hand: the clock time the next heartbeat is due (see ``_clock_moved``).
        self._heartbeat_clock_due: datetime | None = None
        # The lease as last written: its expiry on the runtime clock, and when (loop time) it was written.
        self._lease_expires_at = lease.expires_at
        self._lease_renewed_at = self.loop.time()
        # Step outputs of this attempt, written one transaction at a time (see ``complete_step``).
        self._steps: Batcher[StepCompletion, tuple[RunStepRecord, bool]] | None = None
        self._task_context: TaskContext | None = None
        self._storage_retry_s = 0.0  # the delay of the current run of storage retries; 0 when none
        self._storage_down_since: float | None = None  # loop time of the first failure of an outage
        # The awaitables ``ctx`` handed an ``async def`` handler, each with how it was called (see ``unawaited``).
        self._calls: list[tuple[Coroutine[Any, Any, Any], str]] = []
        # Step calls of an ``async def`` handler that have started and not ended, and step writes that go on
        # once their call was cancelled (see ``settle_steps``).
        self._steps_running: set[asyncio.Future[None]] = set()
        # Step key -> what a second call of that key waits for while a first one of this attempt runs it.
        self._step_key_locks: dict[str, asyncio.Lock] = {}
        self._step_key_holders: dict[str, object] = {}  # step key -> the task or thread running it

    # -- threads -----------------------------------------------------------------------------------

    def handler_is_caller(self) -> bool:
        """Whether the code running here is this attempt's handler itself (its task, or the thread of a
        ``def`` handler), which cannot wait for the attempt to end; a task it started can."""
        if self.on_loop_thread():
            return asyncio.current_task() in (self._handler_task, self._handler_runner)
        return True

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def call_on_loop(self, coroutine: Coroutine[Any, Any, Any], call: str) -> Any:
        """Run ``coroutine`` on the attempt's loop from a handler thread and wait for its result. Once that
        loop has closed (a thread kept a ``ctx`` past its attempt and its runtime), ``call`` is refused as a
        ``ctx`` kept past its attempt is (``check_live``), not with the loop's ``RuntimeError``."""
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        except RuntimeError:
            coroutine.close()  # it never ran: no "never awaited" warning
            if self.loop.is_closed():
                self.check_live(call)
            raise
        return future.result()

    def handed_out(self, coroutine: Coroutine[Any, Any, Any], call: str) -> Coroutine[Any, Any, Any]:
        """``coroutine``, which ``ctx`` returns to an ``async def`` handler as ``call``, remembered so that a
        forgotten ``await`` is reported instead of the work silently not happening."""
        calls = self._calls
        if len(calls) >= 256:  # a long handler: forget the calls that have run
            calls[:] = [item for item in calls if inspect.getcoroutinestate(item[0]) == inspect.CORO_CREATED]
        calls.append((coroutine, call))
        return coroutine

    async def unawaited(self) -> RunlaneError | None:
        """The error for the ``ctx`` calls the handler never awaited (their work never happened), or ``None``.

        A call handed to ``asyncio.create_task`` just before the handler returned has not started yet
        either: one pass of the loop lets it start first."""
        never = [item for item in self._calls if inspect.getcoroutinestate(item[0]) == inspect.CORO_CREATED]
        if not never:
            return None
        await asyncio.sleep(0)
        never = [item for item in never if inspect.getcoroutinestate(item[0]) == inspect.CORO_CREATED]
        if not never:
            return None
        for coroutine, _ in never:
            coroutine.close()  # reported below, not as a "never awaited" warning at collection
        calls = ", ".join(call for _, call in never[:3]) + (f" and {len(never) - 3} more" if len(never) > 3 else "")
        return RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Task {self.run.task_id!r} returned without awaiting {calls}, so {'it' if len(never) == 1 else 'they'} "
            "never ran; in an async def handler, ctx.trigger(), ctx.get_run() and ctx.step.run() return "
            "awaitables: await them.",
            meta={"calls": [call for _, call in never]},
        )

    # -- signal sources --------------------------------------------------------------------------

    def observe_cancellation(self) -> None:
        self.cancel_observed = True
        self.controller.abort(REASON_CANCELLATION_REQUESTED)

    def given_up(self) -> bool:
        """Whether the handler was told to stop and has not, for longer than it is given: cancellation was
        requested and the lease, no longer extended since, has run out; or the deadline passed more than
        ``TIMEOUT_GRACE_S`` ago. Maintenance may then record the cancellation or the timeout while the
        handler still runs, as it would for an attempt of another process. Measured on the loop's steady
        time, which a step of the wall clock does not move (on a clock moved by hand, such as
        ``ControlledClock``, on that clock). From any thread."""
        if self._finished:
            return False
        lease_over_at = self._lease_renewed_at + self.options.lease_ms / 1000
        if self.cancel_observed and self._passed(self._lease_expires_at, lease_over_at):
            return True
        deadline = self.run.attempt_deadline_at
        return (
            self.timed_out
            and deadline is not None
            and self._passed(self._grace_over_at(deadline), self._timed_out_at + TIMEOUT_GRACE_S)
        )

    def _passed(self, on_clock: datetime, on_loop: float) -> bool:
        """Whether a moment has passed: ``on_clock`` on a clock moved by hand, else ``on_loop`` (loop time)."""
        if self._unwatch_clock is not None:
            return self.runtime.now() >= on_clock
        return self.loop.time() >= on_loop

    def stop(self, reason: str) -> None:
        """Abort the signal as a stop does (not a cancellation: the handler's outcome stands). From any thread."""
        self.controller.abort(reason)

    def _deadline_reached(self) -> None:
        self._deadline_handle = None
        if self._finished or self.timed_out:
            return
        self.timed_out = True
        self._timed_out_at = self.loop.time()
        self.controller.abort(REASON_ATTEMPT_TIMED_OUT)
        # An async def handler still running a moment later is cancelled at the await it is stuck in,
        # so the attempt ends and frees its slot; a def handler's thread cannot be interrupted. On a
        # clock moved by hand that moment comes when the clock passes it (see ``_clock_moved``).
        if self._unwatch_clock is None:
            self._deadline_handle = self.loop.call_later(TIMEOUT_GRACE_S, self._cancel_handler)

    def _cancel_handler(self) -> None:
        self._deadline_handle = None
        task = self._handler_task
        if task is None or task.done() or self._finished or not self.timed_out or self._handler_cancelled:
            return
        self._handler_cancelled = True
        task.cancel(f"The attempt of run {self.run_id} passed its max_attempt_duration deadline.")

    def start_timers(self) -> None:
        loop = self.loop
        deadline = self.run.attempt_deadline_at
        # A clock moved by hand (``ControlledClock``) reaches the deadline, the end of the grace after it
        # and the heartbeats' times when it is moved there, never on wall time: a handler may take any
        # wall time while the clock stands still, and the lease of a handler still running never lapses
        # in the clock's time.
        watch = getattr(self.runtime.clock, "watch", None)
        if callable(watch):
            self._heartbeat_clock_due = self._next_clock_heartbeat()
            self._unwatch_clock = watch(self._clock_moved)
            if deadline is not None:
                now = self.runtime.now()
                if now >= deadline:
                    self._deadline_reached()
                    if now >= self._grace_over_at(deadline):
                        loop.call_soon(self._cancel_handler)  # once the handler's task exists
        elif deadline is not None:
            remaining = (deadline - self.runtime.now()).total_seconds()
            if remaining <= 0:
                self._deadline_reached()
            else:
                self._deadline_handle = loop.call_later(remaining, self._deadline_reached)
        self._schedule_heartbeat()

    def _next_clock_heartbeat(self) -> datetime:
        return later(self.runtime.now(), self.options.heartbeat_ms)

    @staticmethod
    def _grace_over_at(deadline: datetime) -> datetime:
        return later(deadline, round(TIMEOUT_GRACE_S * 1000))

    def _clock_moved(self, now: datetime) -> None:
        if self._finished:
            return
        deadline = self.run.attempt_deadline_at
        due = self._heartbeat_clock_due
        with contextlib.suppress(RuntimeError):  # the attempt's loop has closed
            if deadline is not None and now >= deadline:
                self.loop.call_soon_threadsafe(self._deadline_reached)
                if now >= self._grace_over_at(deadline):  # one move may pass both
                    self.loop.call_soon_threadsafe(self._cancel_handler)
            elif due is not None and now >= due:
                self._heartbeat_clock_due = None  # until that heartbeat has been written
                self.loop.call_soon_threadsafe(self._heartbeat_now)

    def _schedule_heartbeat(self) -> None:
        interval = self.options.heartbeat_ms / 1000
        self._heartbeat_due_at = self.loop.time() + interval
        self._heartbeat_handle = self.loop.call_later(interval, self._heartbeat_due)

    async def stop_timers(self) -> None:
        self._finished = True
        if self._unwatch_clock is not None:
            self._unwatch_clock()
            self._unwatch_clock = None
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
            self._deadline_handle = None
        if self._heartbeat_handle is not None:
            self._heartbeat_handle.cancel()
            self._heartbeat_handle = None
            self._warn_if_the_loop_was_blocked()  # the handler may have blocked the loop to its very end
        task = self._heartbeat_task
        if task is not None and not task.done():
            # Let an in-flight heartbeat land so the completion is ordered after it.
            try:
                await asyncio.shield(task)
            except Exception:
                pass

    # -- storage outages --------------------------------------------------------------------------

    def _retry_storage(self, error: RunlaneError, what: str) -> bool:
        """Whether to retry ``what`` (a heartbeat, the outcome) after ``self._storage_retry_s``: only in a
        worker, only for ``storage_unavailable``, and only while the lease will still hold by then (on the
        runtime clock and in elapsed time), so no other worker can have claimed the run meanwhile."""
        if not self.options.ride_out_outages or error.code is not ErrorCode.STORAGE_UNAVAILABLE:
            return False
        now = self.loop.time()
        if self._storage_down_since is None:
            self._storage_down_since = now
        shared = self.options.outage_clock
        down = now - (self._storage_down_since if shared is None else shared.down(now))
        limit = self.options.outage_limit_s
        stop = self.options.signal
        if stop is not None and stop.aborted:  # the worker is stopping: it waits a bounded time
            limit = DRAIN_OUTAGE_LIMIT_S if limit is None else min(limit, DRAIN_OUTAGE_LIMIT_S)
        delay = min(max(self._storage_retry_s * 2, _STORAGE_RETRY_START_S), _STORAGE_RETRY_MAX_S)
        margin = 2 * delay
        left = min(
            (self._lease_expires_at - self.runtime.now()).total_seconds(),
            self._lease_renewed_at + self.options.lease_ms / 1000 - now,
        )
        if left <= margin or (limit is not None and down + delay > limit):
            if what == "outcome":
                run = self.run
                _task_log.warning(
                    "Run %s (task %s): gave up writing the outcome of attempt %d after %.0f s without storage; "
                    "the run stays running until its lease expires (%s), then runs again.",
                    run.id, run.task_id, self.attempt_number, down, encode_iso_date(self._lease_expires_at),
                    extra=_log_fields(run, error.code),
                )  # fmt: skip
            return False
        if not self._storage_retry_s:
            run = self.run
            _worker_log.warning(
                "Run %s (task %s): storage failed (%s) writing the %s of attempt %d; retrying while its lease "
                "holds (%.1f s).",
                run.id, run.task_id, error.code.value, what, self.attempt_number, left,
                extra=_log_fields(run, error.code),
            )  # fmt: skip
        self._storage_retry_s = delay
        return True

    async def riding_out(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``call()`` (the outcome's write, a durable step's read or write, a child trigger, a run read),
        retried through a storage outage while the lease holds, as heartbeats are: an outage of a second
        must not fail the attempt and run the handler's side effects again on the retry."""
        while True:
            try:
                result = await call()
            except StorageLimitError:
                raise
            except RunlaneError as error:
                if not self._retry_storage(error, what):
                    raise
                await asyncio.sleep(self._storage_retry_s)
                continue
            self._storage_recovered(what)
            return result

    def _storage_recovered(self, what: str) -> None:
        self._storage_down_since = None
        shared = self.options.outage_clock
        if shared is not None:
            shared.up()
        if self._storage_retry_s:
            self._storage_retry_s = 0.0
            run = self.run
            _worker_log.warning(
                "Run %s (task %s): storage is reachable again; the %s of attempt %d was written.",
                run.id, run.task_id, what, self.attempt_number, extra=_log_fields(run),
            )  # fmt: skip

    # -- heartbeats ------------------------------------------------------------------------------

    def heartbeat_soon(self) -> None:
        """Heartbeat now rather than at the next interval (from any thread); a no-op once the attempt
        has finished or while a heartbeat is in flight (it reads the run's current state anyway)."""
        with contextlib.suppress(RuntimeError):  # the attempt's loop has closed: nothing left to check
            self.loop.call_soon_threadsafe(self._heartbeat_now)

    def check_cancellation_soon(self) -> None:
        """Read the run to see whether cancellation was requested, unless that was done within the last
        second (from any thread). A read, not a heartbeat: it may come on every commit of other processes."""
        if self._finished or self.cancel_observed or self._cancellation_check_deferred:
            return  # read off the loop: at worst one call too many, and busy lanes send many hints
        with contextlib.suppress(RuntimeError):  # the attempt's loop has closed: nothing left to check
            self.loop.call_soon_threadsafe(self._check_cancellation)

    def _check_cancellation(self) -> None:
        if self._finished or self.cancel_observed or self._cancellation_check_deferred:
            return
        wait = self._cancellation_checked_at + _CANCELLATION_CHECK_S - self.loop.time()
        if wait > 0:  # checked within the second: check once more when it is over, so no commit is missed
            self._cancellation_check_deferred = True
            self.loop.call_later(wait, self._deferred_cancellation_check)
            return
        self._cancellation_checked_at = self.loop.time()
        self._cancellation_check = self.loop.create_task(self._read_cancellation())

    def _deferred_cancellation_check(self) -> None:
        self._cancellation_check_deferred = False
        self._check_cancellation()

    async def _read_cancellation(self) -> None:
        try:
            run = await self.runtime._store.get_run(self.run_id)
        except Exception:  # noqa: BLE001 - the next heartbeat reads it again
            return
        if run is None or run.status is not _CANCELLATION_REQUESTED:
            return
        if run.lease is not None and run.lease.token == self.token:  # this attempt's request, not a later one's
            self.observe_cancellation()

    async def _cancellation_finalized(self) -> bool:
        """Whether maintenance finalized a cancellation of the run (observed now if it was not yet):
        the lease is gone, but the attempt was stopped, not lost."""
        if not self.cancel_observed:
            try:
                run = await self.runtime._store.get_run(self.run_id)
            except Exception:  # noqa: BLE001 - the lease is lost either way
                return False
            if run is None or run.status is not RunStatus.CANCELLED:
                return False
            self.observe_cancellation()
        return True

    def _heartbeat_now(self) -> None:
        if self._finished or (self._heartbeat_task is not None and not self._heartbeat_task.done()):
            return
        if self._heartbeat_handle is not None:
            self._heartbeat_handle.cancel()
        self._heartbeat_due_at = self.loop.time()
        self._heartbeat_due()

    def _heartbeat_due(self) -> None:
        self._heartbeat_handle = None
        if self._finished:
            return
        deadline = self.run.attempt_deadline_at
        now = self.runtime.now
        if deadline is not None and self._unwatch_clock is None and not self.timed_out and now() >= deadline:
            # The deadline is wall-clock time, and the clock stepped past it before its timer (which runs on
            # the loop's steady time) fired: it is reached now.
            if self._deadline_handle is not None:
                self._deadline_handle.cancel()
            self._deadline_reached()
        self._warn_if_the_loop_was_blocked()
        self._heartbeat_task = self.loop.create_task(self._heartbeat())

    def _warn_if_the_loop_was_blocked(self) -> None:
        """Log when the heartbeat timer is overdue by a second (or half its interval): something held the loop.
        Once for a block, whatever the number of attempts whose heartbeats it delayed (each of them finds it
        when the loop runs again), naming the ``async def`` handlers that were running: one of them held it."""
        loop = self.loop
        now = loop.time()
        late = now - self._heartbeat_due_at
        threshold = min(_BLOCKED_LOOP_WARNING_S, max(_LOOP_JITTER_S, self.options.heartbeat_ms / 2000))
        if late < threshold:
            return
        reported = _blocks_reported.get(loop)
        if reported is not None and self._heartbeat_due_at < reported and now - reported < threshold:
            return  # due during the block just reported, and found right after that report: the same block
        _blocks_reported[loop] = now
        run = self.run
        runs_by_task: dict[str, set[str]] = {}
        for attempt in self.runtime.registry.async_handlers_on(loop):
            runs_by_task.setdefault(attempt.run.task_id, set()).add(attempt.run_id)
        running = [
            f"{task_id} (run {next(iter(runs))})" if len(runs) == 1 else f"{task_id} ({len(runs)} runs)"
            for task_id, runs in sorted(runs_by_task.items())
        ]
        shown = ", ".join(running[:_BLOCKING_CANDIDATES_SHOWN]) + (
            f" and {len(running) - _BLOCKING_CANDIDATES_SHOWN} more tasks"
            if len(running) > _BLOCKING_CANDIDATES_SHOWN
            else ""
        )
        culprits = (
            f"The async def handlers running in this process then: {shown}; a blocking call in one of them stops "
            "every attempt of the process (this is logged once for all of them): run it with asyncio.to_thread() "
            "or write the handler as a def."
            if shown
            else "No async def handler was running: other code on the loop blocked it (an observer, a hook, the "
            "application's own), or the whole process was paused (SIGSTOP, a suspended machine); either stops every "
            "attempt of the process (this is logged once for all of them)."
        )
        _worker_log.warning(
            "The event loop was blocked for about %.1f s: the heartbeat of run %s (task %s) was due that long "
            "ago, and its lease lasts %s. %s",
            late, run.id, run.task_id, format_duration(self.options.lease_ms), culprits,
            extra=_log_fields(run) | {"blocked_seconds": round(late, 3)},
        )  # fmt: skip

    async def _heartbeat(self) -> None:
        worker_id = self.worker_id
        token = self.token
        lease_ms = self.options.lease_ms
        actor = Actor(type=ActorType.WORKER, id=worker_id)

        def build(run: RunRecord, at: datetime) -> list[RunEvent]:
            lease = run.lease
            if lease is None or lease.worker_id != worker_id:
                raise create_storage_conflict_error(
                    StorageConflictKind.LEASE_OWNERSHIP,
                    f"Lease ownership of run {run.id} was lost: another worker holds it.",
                    meta={"run_id": run.id},
                )
            if run.status is _CANCELLATION_REQUESTED:
                return []  # observed: stop extending the lease so maintenance can finalize it
            return [
                RunLeaseHeartbeatEvent(
                    run_id=run.id,
                    environment=run.environment,
                    occurred_at=at,
                    actor=actor,
                    lease=RunLease(
                        worker_id=worker_id,
                        token=token,
                        claimed_at=lease.claimed_at,
                        expires_at=later(at, lease_ms),
                    ),
                )
            ]

        try:
            result = await self.runtime.loop_state().completions.submit(CompletionRequest(self.run_id, build, token, self.run))
        except RunlaneError as error:
            if is_storage_conflict(error, StorageConflictKind.LEASE_OWNERSHIP):
                if await self._cancellation_finalized():
                    return  # the completion reports the stored cancellation
                self.lost = error
                self.controller.abort(REASON_LEASE_LOST)
            elif not self._finished and self._retry_storage(error, "heartbeat"):
                # Heartbeat again shortly: the handler goes on while the lease still holds.
                self._heartbeat_handle = self.loop.call_later(self._storage_retry_s, self._heartbeat_due)
                self._heartbeat_due_at = self.loop.time() + self._storage_retry_s
            else:
                self.heartbeat_error = error
                self.controller.abort(REASON_HEARTBEAT_FAILED)
            return
        except Exception as error:
            self.heartbeat_error = error
            self.controller.abort(REASON_HEARTBEAT_FAILED)
            return
        lease = result.run.lease
        if lease is not None and lease.token == token and lease.expires_at != self._lease_expires_at:  # extended
            self._lease_expires_at = lease.expires_at
            self._lease_renewed_at = self.loop.time()
        if self._unwatch_clock is not None:
            self._heartbeat_clock_due = self._next_clock_heartbeat()
        self._storage_recovered("heartbeat")
        if result.events:
            await self.runtime.after_append(result)
        if result.run.status is _CANCELLATION_REQUESTED:
            self.observe_cancellation()
            return
        if not self._finished:
            self._schedule_heartbeat()

    def let_go(self) -> None:
        """Drop what refers back to this attempt (its ``TaskContext``, its step batcher's flush), once it
        is over: no reference cycle is left for the cycle collector, which would otherwise keep an
        attempt's signal and everything it links to alive until its next pass."""
        self._task_context = None
        self._steps = None

    @property
    def task_context(self) -> TaskContext:
        """The one ``TaskContext`` of this attempt: the handler's ``ctx``, and ``current_task_context()``."""
        context = self._task_context
        if context is None:
            context = self._task_context = TaskContext(self)
        return context

    # -- handler ---------------------------------------------------------------------------------

    async def run_handler(self) -> _Outcome:
        definition = self.definition
        assert definition is not None
        self._handler_runner = asyncio.current_task()  # an async def handler runs in it (or in _handler_task)
        # Also for a task that takes no payload: a payload stored before it stopped taking one is refused, as a
        # rerun of the run would be.
        try:
            payload = definition.load_payload(self.run.payload)
        except RunlaneError as error:
            return _Outcome(
                _FAILURE,
                failure=_payload_drift_failure(definition, error),
                error=error.__cause__,  # a validator's own exception, for the log
            )
        if definition.takes_context:
            args: tuple[Any, ...] = (payload, self.task_context)
        elif definition.takes_payload:
            args = (payload,)
        else:
            args = ()
        try:
            if definition.is_async:
                if self.run.attempt_deadline_at is None:
                    result = await definition.handler(*args)
                else:  # its own task, so the deadline can cancel it (see _cancel_handler)
                    self._handler_task = asyncio.ensure_future(definition.handler(*args))
                    result = await self._handler_task
            else:
                context = contextvars.copy_context()
                gate = _ThreadGate()
                threads: concurrent.futures.Executor | None = None
                try:
                    threads = self.runtime.handler_threads
                    future = self.loop.run_in_executor(
                        threads, gate.run, context.run, _call_in_thread, definition.handler, args
                    )
                except Exception as error:  # noqa: BLE001 - no thread for the handler: it has not run
                    gate.close()
                    if threads is not None:
                        self.runtime.renew_handler_threads(threads)
                    return self._no_handler_thread(error)
                gate.open()
                result = await future
                if inspect.isawaitable(result):
                    result = await result
        except asyncio.CancelledError as error:
            if being_cancelled():
                raise  # this attempt's task is being cancelled: not the handler's outcome to record
            if self._handler_cancelled:  # cancelled here, past its deadline: the timeout is the outcome
                return _Outcome(_FAILURE, failure=timed_out_failure())
            # The handler let a cancellation of something it awaited escape: a failure of this
            # attempt, not a reason to stop the worker and leave the run running until its lease expires.
            return _Outcome(_FAILURE, failure=failure_from_exception(error), error=error)
        except BaseException as error:
            # Any exception task code raises, however exotic (a BaseException of a library), is this
            # attempt's failure: it must not stop the worker and strand the run. A SystemExit on the main
            # thread still stops it (it may come from the process's own signal handler); on any other
            # thread (runlane.sync's loop, a def handler's) sys.exit() ends only that thread, so there it
            # is the handler's failure, as a def handler's arrives (HandlerExit).
            if isinstance(error, SystemExit):
                if threading.current_thread() is threading.main_thread():
                    raise
                error = _handler_exit(error)
            failure = failure_from_exception(error)
            stopped = _signal_abort_failure(error)
            if (
                stopped is not None
                and self.controller.signal.aborted
                and not self.cancel_observed
                and not self.timed_out
            ):
                if self.controller.signal.reason == REASON_WORKER_STOPPED:
                    # The handler stopped because its worker did (a deploy, a reload, closing the
                    # runtime): the run is not at fault, so it goes back to run again at once, without
                    # spending its retry budget, as a process that crashed would have it run again.
                    return _Outcome(_RELEASE, release=_STOPPED_WITH_THE_WORKER)
                # Another local abort (a caller's signal, a lost lease) is not a durable cancellation
                # either: the failure follows the task's retry policy like any other.
                failure = stopped.model_copy(update={"retryable": True})
            retry = definition.retry
            if failure.retryable and retry is not None and not retry.retries(error):
                failure = failure.model_copy(update={"retryable": False})  # retry_on / no_retry_on
            return _Outcome(_FAILURE, failure=failure, error=error)
        if self._calls:
            forgotten = await self.unawaited()
            if forgotten is not None:
                return _Outcome(_FAILURE, failure=failure_from_exception(forgotten), error=forgotten)
        if isinstance(result, TaskRelease):
            # A release built without ctx.wait_for_run() (TaskRelease(...) itself) is held to its rule too.
            try:
                _refuse_waiting_for_itself(result, self.run_id)
            except RunlaneError as error:
                return _Outcome(_FAILURE, failure=failure_from_exception(error), error=error)
        return _outcome_for_result(result)

    def _no_handler_thread(self, error: Exception) -> _Outcome:
        """The outcome of an attempt whose ``def`` handler got no thread (the process is exiting, or at its
        limit of threads or open files): the handler never ran, so nothing failed; the run is released for
        a while instead of spending its retry budget, and the log says which it was."""
        if _interpreter_exiting(error):
            _worker_log.warning(
                "Run %s (task %s): its def handler did not run: this process is exiting, and the interpreter "
                "starts no more threads for it (%s: %s). The run is released for %s, for a worker to run it "
                "then; to run a def handler in this process, call run_now() before it begins to exit (not "
                "from an atexit hook, nor after the main module has returned).",
                self.run_id, self.run.task_id, type(error).__name__, error, format_duration(_NO_HANDLER_THREAD_MS),
                extra=_log_fields(self.run, None),
            )  # fmt: skip
            return _Outcome(_RELEASE, release=_NO_HANDLER_THREAD)
        _worker_log.error(
            "Run %s (task %s): no thread could be started for its def handler (%s: %s); the handler did not "
            "run, and the run is released for %s. This process is at a limit on threads or open files: run "
            "fewer worker slots (--concurrency) or raise the limit (ulimit -u / -n, the container's pids "
            "limit, systemd TasksMax=).",
            self.run_id, self.run.task_id, type(error).__name__, error, format_duration(_NO_HANDLER_THREAD_MS),
            extra=_log_fields(self.run, None),
        )  # fmt: skip
        return _Outcome(_RELEASE, release=_NO_HANDLER_THREAD)

    # -- completion ------------------------------------------------------------------------------

    def outcome_build(self, outcome: _Outcome) -> Callable[[RunRecord, datetime], list[RunEvent]]:
        actor = worker_actor(self.worker_id)
        retry = None if self.definition is None else self.definition.retry
        timed_out_flag = self.timed_out

        def build(run: RunRecord, at: datetime) -> list[RunEvent]:
            cancelling = run.status is _CANCELLATION_REQUESTED
            kind = outcome.kind
            if cancelling and kind != _FAILURE:
                return [
                    RunCancelledEvent(
                        run_id=run.id,
                        environment=run.environment,
                        occurred_at=at,
                        actor=actor,
                        attempt=run.counters.attempts,
                    )
                ]
            deadline = run.attempt_deadline_at
            if timed_out_flag or (deadline is not None and at >= deadline):
                failure = timed_out_failure()
                return failure_outcome_events(run, at, failure, retry, actor, allow_retry=True)
            if kind == _SUCCESS:
                attempt = run.counters.attempts
                if type(at) is datetime and at.tzinfo is UTC and attempt >= 1:
                    # The output passed the JSON check in _outcome_for_result; the rest comes from
                    # the stored run and the UTC transaction time.
                    values = {
                        "run_id": run.id,
                        "environment": run.environment,
                        "occurred_at": at,
                        "actor": actor,
                        "attempt": attempt,
                        "output": outcome.output,
                        "has_output": outcome.has_output,
                    }
                    return [build_validated(RunSucceededEvent, values)]
                return [
                    RunSucceededEvent(
                        run_id=run.id,
                        environment=run.environment,
                        occurred_at=at,
                        actor=actor,
                        attempt=run.counters.attempts,
                        output=outcome.output,
                        has_output=outcome.has_output,
                    )
                ]
            if kind == _RELEASE:
                assert outcome.release is not None
                return _release_events(run, at, outcome.release, actor)
            assert outcome.failure is not None
            return failure_outcome_events(run, at, outcome.failure, retry, actor, allow_retry=True)

        return build

    async def complete(self, outcome: _Outcome) -> AttemptResult:
        runtime = self.runtime
        request = CompletionRequest(self.run_id, self.outcome_build(outcome), self.token, self.run)
        try:
            try:
                result = await self._submit_outcome(request)
            except StorageLimitError as error:
                # The outcome does not fit the lane (a large output, failure meta or release): the
                # attempt fails with a small failure instead of leaving the run running until its
                # lease expires and the next attempt does the same.
                outcome = _Outcome(_FAILURE, failure=_oversized_outcome_failure(outcome, error))
                request = CompletionRequest(self.run_id, self.outcome_build(outcome), self.token, self.run)
                result = await self._submit_outcome(request)
        except RunlaneError as error:
            if not is_storage_conflict(error, StorageConflictKind.LEASE_OWNERSHIP):
                raise
            # Maintenance may have finalized the cancellation first: report that stored outcome.
            stored = await runtime.store.get_run(self.run_id)
            if stored is not None and stored.status is RunStatus.CANCELLED and self.cancel_observed:
                return AttemptResult(stored)
            if stored is not None and self._timeout_recorded(stored):
                self._log_late()
                return AttemptResult(stored)  # the outcome an attempt past its deadline has
            if stored is not None and await self._outcome_landed(stored):
                # An earlier write of this outcome was reported as failed (a connection lost during its
                # commit: storage_unavailable, its outcome unknown) but was committed: it is recorded, once.
                self._storage_recovered("outcome")
                if run_status_values.is_terminal(stored.status):
                    runtime._wake_finish_waiters(stored.id)
                return AttemptResult(stored)
            return self.abandon(error)
        assert isinstance(result, AppendResult)
        await runtime.after_append(result)
        if result.outbox:  # a release whose awaited run had already finished: resumed in the same commit
            await runtime.publish_resumed([result])
        _log_failed_attempt(result.run, outcome)
        await self._check_wait(result.run)
        return AttemptResult(result.run)

    async def _check_wait(self, run: RunRecord) -> None:
        """A recorded ``wait_for_run`` of a run that does not exist is a wait for a run still to come (a known
        id a producer triggers later): the release stands. Without a timeout nothing else resumes it, and a
        mistyped id (or a run already pruned) is the likelier cause, so that is logged. Not for an outcome
        recorded as something else (a cancellation requested meanwhile, a release too large to store)."""
        wait = run.wait
        if (
            run.status is not RunStatus.RELEASED
            or wait is None
            or wait.type is not RunWaitConditionType.RUN_COMPLETION
            or wait.timeout_at is not None
        ):
            return
        try:
            if await self.runtime.store.get_run(wait.run_id) is not None:
                return
        except RunlaneError:
            return  # storage is away (or the record unreadable): the release is recorded; this is only advice
        _task_log.warning(
            "Run %s (task %s) waits for run %s, which does not exist in environment %r (a mistyped id, a run of "
            "another environment, or one already pruned?). Only a run created with that id and finished resumes "
            "it: give ctx.wait_for_run() a timeout, or cancel the run.",
            run.id, run.task_id, wait.run_id, run.environment.name,
            extra=_log_fields(run) | {"waits_for": wait.run_id},
        )  # fmt: skip

    async def _submit_outcome(self, request: CompletionRequest) -> Any:
        self._storage_retry_s = 0.0  # a heartbeat's retries are over: the timers have stopped
        return await self.riding_out(lambda: self.runtime.loop_state().completions.submit(request), "outcome")

    async def _outcome_landed(self, stored: RunRecord) -> bool:
        """Whether the run's history holds an outcome of this attempt written by this worker: only the
        holder of the attempt's lease writes one, so it is this attempt's own, from a commit whose outcome
        the driver could not report."""
        if stored.lease is not None or stored.counters.attempts != self.attempt_number:
            return False
        actor = worker_actor(self.worker_id)
        after = self.run.event_sequence
        while after < stored.event_sequence:
            try:
                events = await self.runtime.store.list_events(self.run_id, after_sequence=after)
            except RunlaneError:
                return False  # storage is away again: report the lost lease, as before
            if not events:
                return False
            for item in events:
                event = item.event
                if (
                    event.type in _OUTCOME_EVENT_TYPES
                    and getattr(event, "attempt", None) == self.attempt_number
                    and event.actor == actor
                ):
                    return True
            after = events[-1].sequence
        return False

    def _past_deadline(self) -> bool:
        deadline = self.run.attempt_deadline_at
        return deadline is not None and self.runtime.now() >= deadline

    def _timeout_recorded(self, stored: RunRecord) -> bool:
        """Whether maintenance recorded this attempt's timeout (``tick()`` finalizes attempts past their
        deadline, also while their handler still runs), and no later attempt has started since."""
        failure = stored.failure
        return (
            self._past_deadline()
            and stored.status in (RunStatus.RETRYING, RunStatus.FAILED)
            and stored.counters.attempts == self.run.counters.attempts
            and failure is not None
            and failure.code is ErrorCode.TASK_TIMED_OUT
        )

    def _log_late(self) -> None:
        run = self.run
        _task_log.warning(
            "Run %s (task %s): attempt %d ran past its max_attempt_duration deadline and maintenance recorded its "
            "timeout; the handler's own outcome came too late to be recorded.",
            run.id, run.task_id, run.counters.attempts,
            extra=_log_fields(run, ErrorCode.TASK_TIMED_OUT),
        )  # fmt: skip

    def log_lease_given_up(self, error: BaseException) -> None:
        """Say on ``runlane.task`` that this attempt's outcome is not recorded because its lease could not be
        renewed (storage failed past what the lease allowed): the run runs again once the lease expires."""
        run = self.run
        cause = f"{error.code.value}: {error.message}" if isinstance(error, RunlaneError) else type(error).__name__
        code = error.code if isinstance(error, RunlaneError) else ErrorCode.STORAGE_UNAVAILABLE
        _task_log.warning(
            "Run %s (task %s): attempt %d could not renew its lease (%s), so its handler was told to stop "
            "(ctx.signal) and whatever it returned is not recorded: the run runs again once its lease expires "
            "(%s), and what the handler did before it stopped is done again unless it is idempotent.",
            run.id, run.task_id, self.attempt_number, cause, encode_iso_date(self._lease_expires_at),
            extra=_log_fields(run, code),
        )  # fmt: skip

    def abandon(self, conflict: RunlaneError) -> AttemptResult:
        """The attempt lost its lease: nothing of it is persisted (another owner may be running the run)."""
        run = self.run
        if self._past_deadline():
            self._log_late()
            return AttemptResult(None, True, conflict)
        _task_log.warning(
            "Run %s (task %s): attempt %d lost its lease; its outcome is not recorded (%s).",
            run.id, run.task_id, run.counters.attempts, conflict.message,
            extra=_log_fields(run, conflict.code),
        )  # fmt: skip
        return AttemptResult(None, True, conflict)

    async def complete_step(self, step_key: str, token: str, stored: Any) -> None:
        """Store a step's output. Steps completing together (``asyncio.gather`` over ``ctx.step.run``)
        share one transaction, and one at a time: each step write updates the run's record, so concurrent
        transactions of one attempt would only fail each other's validation."""
        runtime = self.runtime
        steps = self._steps
        if steps is None:
            store = runtime.store

            async def flush(batch: list[StepCompletion]) -> list[tuple[RunStepRecord, bool] | RunlaneError]:
                return await store.complete_steps(self.run_id, self.token, self.attempt_number, batch)

            steps = self._steps = Batcher(flush, max_batch_size=store.step_batch_size())
        try:
            step, created = await steps.submit(StepCompletion(step_key, token, stored))
        except StorageLimitError as error:
            raise RunlaneError(
                ErrorCode.TASK_OUTPUT_INVALID,
                error.too_large(f"Step {step_key!r} output", _STORE_LARGE_DATA_ELSEWHERE),
                retryable=True,
                meta={"step_key": step_key, **error.meta},
            ) from None
        if created:
            await runtime.observe_step(step, self.run)

    # -- child triggers --------------------------------------------------------------------------

    def step_key_lock(self, key: str, caller: object) -> asyncio.Lock:
        """The lock calls of step ``key`` in this attempt take in turn, on the attempt's loop whether they are
        awaited or come from threads (made on first use; kept for the attempt, one per key it runs). A call
        from inside the ``fn`` of the same key (``caller``, its task or thread, holds it) would wait for
        itself: it is refused instead."""
        with _STEP_KEYS_LOCK:
            if self._step_key_holders.get(key) == caller:
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID,
                    f"ctx.step.run({key!r}) was called from inside the fn of that same step; give the inner step "
                    "a key of its own.",
                    meta={"step_key": key},
                )
            lock = self._step_key_locks.get(key)
            if lock is None:
                lock = self._step_key_locks[key] = asyncio.Lock()
        return lock

    @contextlib.contextmanager
    def step_key_held(self, key: str, caller: object) -> Iterator[None]:
        """Who runs step ``key`` now (under its ``step_key_lock``), for ``step_key_lock`` to tell a nested call."""
        with _STEP_KEYS_LOCK:
            self._step_key_holders[key] = caller
        try:
            yield
        finally:
            with _STEP_KEYS_LOCK:
                del self._step_key_holders[key]

    @contextlib.contextmanager
    def step_running(self) -> Iterator[None]:
        """Around one step call of an ``async def`` handler, so the attempt can wait for it (``settle_steps``)."""
        ended: asyncio.Future[None] = self.loop.create_future()
        self._steps_running.add(ended)
        try:
            yield
        finally:
            self._steps_running.discard(ended)
            ended.set_result(None)

    async def storing_step(self, write: Coroutine[Any, Any, None]) -> None:
        """Await the write of a step output whose ``fn`` has done its work, which goes on if the call is
        cancelled meanwhile (a sibling's failure in an ``asyncio.TaskGroup``, an ``asyncio.wait_for``
        timeout): the output is stored, and the attempt waits for it (``settle_steps``), instead of the work
        being done again by the next attempt."""
        written = asyncio.ensure_future(write)
        self._steps_running.add(written)
        written.add_done_callback(self._step_stored)
        await asyncio.shield(written)

    def _step_stored(self, written: asyncio.Future[None]) -> None:
        self._steps_running.discard(written)
        if not written.cancelled():
            written.exception()  # a caller cancelled meanwhile cannot take it: not "never retrieved"

    async def settle_steps(self) -> None:
        """Wait for the step calls the handler left running when it returned or raised (steps side by side
        in ``asyncio.gather``, one of which failed): a step whose ``fn`` has done its work stores its
        output, instead of that work being done again by the next attempt. Not past the attempt's end:
        a deadline, a cancellation or a worker stop (its signal aborted) stops the wait."""
        signal = self.controller.signal
        while self._steps_running and not signal.aborted:
            aborted = asyncio.ensure_future(signal.wait())
            try:
                await asyncio.wait([*self._steps_running, aborted], return_when=asyncio.FIRST_COMPLETED)
            finally:
                aborted.cancel()

    def check_live(self, call: str, stored: RunRecord | None = _NOT_READ) -> None:
        """Refuse ``call`` from a ``TaskContext`` whose attempt can no longer act for its run: its handler has
        returned, it lost its lease, it passed its ``max_attempt_duration`` deadline (its outcome is a
        timeout, which maintenance may record at any time), or its cancellation was requested and its lease,
        no longer extended since, has run out (maintenance may record the cancellation at any time). With
        ``stored``, the run as just read, also when another attempt holds the run now. Only the lease
        owner acts for the run: a reference kept in a callback or a background task, or a handler that
        goes on after its attempt ended, must not create work linked to it. The refusal is the one
        storage gives a late step write of such a context: ``storage_conflict`` (``lease_ownership``)."""
        number = self.attempt_number
        if self._finished:
            why = f"attempt {number} has ended"
        elif self.lost is not None:
            why = f"attempt {number} lost it"
        elif self.timed_out or self._past_deadline():
            why = f"attempt {number} passed its max_attempt_duration deadline"
        elif self.given_up():
            why = f"attempt {number} was cancelled and its lease has run out"
        elif stored is not _NOT_READ and not self._holds(stored):
            why = f"attempt {number} no longer holds it"
        else:
            return
        raise create_storage_conflict_error(
            StorageConflictKind.LEASE_OWNERSHIP,
            f"Lease ownership of run {self.run_id} was lost: {why}. Call {call} only from the handler while it runs; "
            "a TaskContext kept past its attempt (in a callback or a background task) cannot act for the run.",
            meta={"run_id": self.run_id},
        )

    def _holds(self, run: RunRecord | None) -> bool:
        """Whether ``run``, as stored, is still held by this attempt's lease."""
        if run is None or run.status not in (RunStatus.RUNNING, _CANCELLATION_REQUESTED):
            return False
        lease = run.lease
        return lease is not None and lease.token == self.token

    async def trigger_child(self, task: Any, payload: Any, options: dict[str, Any]) -> TriggerRunResult:
        self.check_live("ctx.trigger()")
        runtime = self.runtime
        unknown = set(options) - _CHILD_TRIGGER_OPTIONS
        if unknown:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"Unknown trigger option(s) {sorted(unknown)}; ctx.trigger() takes {sorted(_CHILD_TRIGGER_OPTIONS)}.",
            )
        if options.get("trace_carrier") is None and self.run.trace_carrier is not None:
            options = {**options, "trace_carrier": self.run.trace_carrier}
        # No closed check here: a closing runtime lets running attempts finish, child triggers included.
        spec = runtime.prepare_create(
            task, payload, source=RunSource(type=RunSourceType.TRIGGER, source_run_id=self.run_id), **options
        )
        return await runtime.create_triggered(spec)


_CHILD_TRIGGER_OPTIONS = frozenset(
    {
        "actor",
        "concurrency_key",
        "idempotency_key",
        "idempotency_key_ttl",
        "meta",
        "queue",
        "run_at",
        "delay",
        "run_id",
        "singleton_key",
        "trace_carrier",
    }
)


def _payload_drift_failure(definition: TaskDefinition, error: RunlaneError) -> RunFailure:
    """``validation_failed``: the run's stored payload no longer matches its task's schema (a deploy changed
    the schema after the run was triggered). The message names the fields from the persistable errors (the
    validation's own summary may quote the stored value) and says how to get the run going again."""
    meta = json.loads(canonical_json(error.meta)) if is_json_value(error.meta) else {}
    errors = meta.get("errors")
    if isinstance(errors, list) and errors:
        summary = summarize_errors(errors)
    elif isinstance(meta.get("error_type"), str):
        summary = f"its validation raised {meta['error_type']}"
    elif not definition.takes_payload:
        summary = "the task takes no payload now"
    else:
        summary = "it does not validate"
    return RunFailure(
        code=ErrorCode.VALIDATION_FAILED,
        message=(
            f"Task payload no longer matches the schema of task {definition.id!r}: {summary}. It was stored under an "
            "earlier schema: deploy a schema that still reads what queued runs hold (new fields optional or with "
            "defaults, old types still accepted) and retry this run, or trigger a new run with a payload that matches."
        ),
        retryable=False,
        meta=meta,
    )


def abandoned_attempts(run: RunRecord) -> int:
    """How many of the run's attempts before the current one ended with no outcome: their worker
    crashed, was killed or lost the lease (every other attempt ended in a failure or a release)."""
    counters = run.counters
    return max(0, counters.attempts - 1 - counters.failures - counters.releases)


def _not_run_failure(run: RunRecord, definition: TaskDefinition | None) -> RunFailure | None:
    """The failure an attempt records without calling the handler: its task is not registered, or the
    run's earlier attempts spent the budget by ending with no outcome (a run that takes its worker
    down each time it runs would otherwise run again, and take a worker down, at every lease expiry)."""
    if definition is None:
        return RunFailure(
            code=ErrorCode.TASK_NOT_FOUND,
            message=(
                f"Task {run.task_id!r} is not registered in the runtime of the worker that claimed this run: run its "
                f"queue {run.queue!r} only on workers that register the task (deploy them before triggering it, keep "
                "it until its runs finish), then retry this run."
            ),
            retryable=False,
            meta={"task_id": run.task_id},
        )
    abandoned = abandoned_attempts(run)
    if not abandoned:
        return None
    budget = max(ABANDONED_ATTEMPTS_LIMIT, 1 if definition.retry is None else definition.retry.max_attempts)
    spent = run.counters.attempts - 1 - run.counters.releases
    if spent < budget:
        return None
    _task_log.error(
        "Run %s of task %s is failed without running it again: %d of its attempts ended with no outcome "
        "(the worker running them crashed, was killed, or lost the lease), and its %d attempts are spent.",
        run.id, run.task_id, abandoned, budget,
        extra={"run_id": run.id, "task_id": run.task_id},
    )  # fmt: skip
    return RunFailure(
        code=ErrorCode.TASK_FAILED,
        message=(
            f"Task failed: {abandoned} of its attempts ended with no outcome (the worker running them crashed, "
            f"was killed, or lost the lease) and its {budget} attempts are spent; it is not run again."
        ),
        retryable=False,
        meta={"abandoned_attempts": abandoned, "max_attempts": budget},
    )


# The attempt whose handler (or anything it started) is running, so closing the runtime from there does
# not wait for the very attempt that closes it.
_current_attempt: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar("runlane_attempt", default=None)


def refuse_waiting_for_itself(runtime: Runlane, what: str, worker_signal: object = None) -> None:
    """Refuse ``what`` (``runlane.close()``, a worker's ``stop()``) called by a handler of ``runtime`` (of
    that worker, whose stop signal is ``worker_signal``): it would wait for that very handler to end (its
    own task for an ``async def`` handler, its thread for a ``def`` one). Anything else may go on: a task
    the handler started to close the runtime in the background, say."""
    attempt = _current_attempt.get()
    if attempt is None or attempt.runtime is not runtime:
        return
    if worker_signal is not None and attempt.options.signal is not worker_signal:
        return  # another worker's attempt: this stop does not wait for it
    if not attempt.handler_is_caller():
        return
    if attempt.on_loop_thread():
        later = "asyncio.create_task(...) of it, which goes on once the handler returns"
    else:
        later = "a call of it after the handler returns, from code other than the handler"
    raise RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"{what} was called by the handler of run {attempt.run_id} and would wait for that handler to end; "
        f"return from the handler first, or use {later}.",
        meta={"run_id": attempt.run_id},
    )


def refuse_waiting_for_its_own_run(runtime: Runlane, run_id: str, what: str) -> None:
    """Refuse ``what`` (``runs.wait()``) of run ``run_id`` called by that run's own handler: the run cannot
    finish before its handler returns, so the wait would last for ever (until its timeout)."""
    attempt = _current_attempt.get()
    if attempt is None or attempt.run_id != run_id or attempt.runtime.environment != runtime.environment:
        return
    if not attempt.handler_is_caller():
        return
    raise RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"{what} was called by the handler of run {run_id} for that same run, which cannot finish before its "
        "handler returns; wait for another run (ctx.wait_for_run() releases this one meanwhile).",
        meta={"run_id": run_id},
    )


def current_task_context() -> TaskContext | None:
    """The ``TaskContext`` of the attempt whose handler is running here: in the handler itself, in the
    thread of a ``def`` handler, and in asyncio tasks the handler started; ``None`` anywhere else. For
    code the handler calls that should not have to take ``ctx`` as an argument (a logging helper, a
    client library that tags its requests with the run id)."""
    attempt = _current_attempt.get()
    return None if attempt is None else attempt.task_context


class RunContextFilter(logging.Filter):
    """A ``logging`` filter that gives every record emitted while a handler runs the attempt's
    ``run_id``, ``task_id``, ``attempt`` and ``queue`` (``None`` elsewhere), so a format string or a
    JSON formatter can show which run a line of your own logging belongs to::

        handler = logging.StreamHandler()
        handler.addFilter(RunContextFilter())
        handler.setFormatter(logging.Formatter("%(levelname)s run=%(run_id)s %(name)s: %(message)s"))

    It never drops a record, and it leaves fields a record already carries (Runlane's own log records
    name their run) as they are. A record naming another run than the attempt's (an observer that failed
    on the run a handler triggered) gets none of the attempt's fields: they would describe another run."""

    def filter(self, record: logging.LogRecord) -> bool:
        attempt = _current_attempt.get()
        named = record.__dict__.get("run_id", attempt.run_id if attempt is not None else None)
        fields = (
            (None, None, None, None)
            if attempt is None or named != attempt.run_id
            else (attempt.run_id, attempt.run.task_id, attempt.attempt_number, attempt.run.queue)
        )
        for name, value in zip(_RUN_CONTEXT_FIELDS, fields):
            if name not in record.__dict__:
                setattr(record, name, value)
        return True


_RUN_CONTEXT_FIELDS = ("run_id", "task_id", "attempt", "queue")

# The claim (``CancellationRegistry.claiming``) whose call is running: its attempt, once begun, ends it.
_claim_in_flight: contextvars.ContextVar[object | None] = contextvars.ContextVar("runlane_claim", default=None)


async def execute_claimed_run(
    runtime: Runlane, run: RunRecord, definition: TaskDefinition | None, options: ExecutionOptions
) -> AttemptResult:
    """Execute one attempt of a run this process just claimed (status ``running``, attempt started)."""
    attempt = _Attempt(runtime, run, definition, options)
    registry = runtime.registry
    registry.begin(attempt)  # until its outcome is written: closing the runtime waits for it
    scope = _current_attempt.set(attempt)
    try:
        failure = _not_run_failure(run, definition)
        stop = options.signal  # a worker's stop (or the signal given to execute_next)
        if failure is not None or (stop is not None and stop.aborted and stop.reason == REASON_WORKER_STOPPED):
            # A claim that committed once its worker had stopped (it waited for a busy database meanwhile)
            # goes back at once, as a handler that raised on the stop would: the worker no longer claims,
            # so it starts no handler that could outlast the process manager's stop timeout.
            stopped = _Outcome(_RELEASE, release=_STOPPED_WITH_THE_WORKER)
            try:
                return await attempt.complete(stopped if failure is None else _Outcome(_FAILURE, failure=failure))
            finally:
                attempt.controller.unlink()
        registry.register(attempt)
        try:
            attempt.start_timers()
            try:
                outcome = await attempt.run_handler()
                await attempt.settle_steps()
            finally:
                await attempt.stop_timers()
        finally:
            registry.unregister(attempt)
            attempt.controller.unlink()
        if attempt.lost is not None:
            return attempt.abandon(attempt.lost)
        if attempt.heartbeat_error is not None:
            attempt.log_lease_given_up(attempt.heartbeat_error)
            raise attempt.heartbeat_error
        return await attempt.complete(outcome)
    finally:
        _current_attempt.reset(scope)
        registry.end(attempt)
        attempt.let_go()
