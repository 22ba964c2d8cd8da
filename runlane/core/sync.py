"""``runlane.sync``: the blocking facade for synchronous producers (Django, Flask, scripts).

Every method has the same name and options as its ``async`` counterpart on ``Runlane`` and blocks
until it finishes. Calls run on an event loop this facade owns, in a daemon thread started on first
use, so synchronous code needs no event loop of its own. The runtime keeps per-loop batchers and
thread-safe signals, so the facade can be used while an application loop serves the same runtime.

Do not call the facade from ``async`` code (a thread running an event loop): it would block that
loop, and deadlock when the call waits on it; it raises instead. ``close()`` waits a few seconds for
calls still running on the facade loop (they fail once the lane is closed), then cancels the rest:
a caller never waits on a loop that has stopped. A ``runs.wait()`` whose caller is interrupted (Ctrl-C)
stops waiting. A process that exits without ``close()`` closes the runtime the facade started (its
workers and attempts, then the lane) on the way out: its workers stop when the main module returns,
before the interpreter waits for its threads; the runtime closes in an ``atexit`` hook. A facade first
used by an ``atexit`` hook closes its runtime at the end of each call.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import builtins
import concurrent.futures
import importlib
import inspect
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ..errors import ErrorCode, RunlaneError
from ..models import Environment, Page, RunAttemptSummary, RunEventRecord, RunRecord, RunStepRecord, RunSummary
from .attempt import REASON_WORKER_STOPPED, refuse_waiting_for_its_own_run, refuse_waiting_for_itself
from .runtime import ObservationsApi, RunsApi, Runlane, SignalsApi

if TYPE_CHECKING:
    from .authoring import QueueDefinition, TaskDefinition
    from .lanes import Lane
    from .observations import ObservationPage, ObservationTrimResult
    from .pruning import PruneResult
    from .runtime import ExecuteDeliveryResult, Registry, TickResult, TriggerRunResult
    from .worker import WorkerHandle

__all__ = ["SyncRunlane", "SyncWorkerHandle"]

T = TypeVar("T")
P = ParamSpec("P")


def _options_of(
    counterpart: Callable[Concatenate[Any, P], Any],
) -> Callable[[Callable[..., T]], Callable[Concatenate[Any, P], T]]:
    """Give a facade method the parameters of its ``async`` counterpart, for type checkers: a misspelt
    or mistyped option is reported where it is written, as on ``Runlane``. The method is returned as
    written; it passes its options through to the counterpart, which checks them."""

    def mirror(method: Callable[..., T]) -> Callable[Concatenate[Any, P], T]:
        return method

    return mirror

# How long ``close()`` lets calls still running on the facade loop finish before it cancels them.
_CLOSE_GRACE_S = 5.0
# How long a process that exits without ``close()`` waits for the runtime the facade started to close.
_EXIT_CLOSE_S = 10.0


def _refuse_in_event_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        "runlane.sync blocks its caller, and this thread runs an event loop (async code): await the async "
        "API there instead (await runlane.trigger(...), await runlane.close()).",
    )


# The facades whose loop runs, closed by one exit hook: a process that makes runtime after runtime (a test
# suite, a runtime per request) must not collect an exit hook per runtime.
_RUNNING_FACADES: weakref.WeakSet[SyncRunlane] = weakref.WeakSet()


# Set once the exit hook has run: a facade used after that (by an ``atexit`` hook registered before
# runlane was imported) closes its runtime at the end of each call, as nothing else will.
_exit_hook_done = False


def _stop_workers_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_CLOSE_S
    for facade in list(_RUNNING_FACADES):
        facade._stop_workers_at_exit(max(deadline - time.monotonic(), 0.0))


def _close_all_at_exit() -> None:
    global _exit_hook_done
    _exit_hook_done = True
    for facade in list(_RUNNING_FACADES):
        _close_at_exit(weakref.ref(facade))


# Registered when runlane is imported, as an ``atexit`` hook like the application's: hooks the application
# registers after importing runlane (the usual order) run before it, so they can use the facade, as many
# calls as they make, and threads still running when the main module returns can use it until they end.
atexit.register(_close_all_at_exit)


def _forget_loops_after_fork() -> None:
    """In a forked child, forget the loop of every facade that had one: its thread stayed with the parent,
    so a call sent to it would wait for ever. A facade whose runtime was started is refused with it (see
    ``Runlane._forked``); one whose runtime was not (its first call failed, storage down say) starts a
    loop and the runtime of its own on its next call, as one first used after the fork does."""
    for facade in list(_RUNNING_FACADES):
        facade.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loops_after_fork)


@functools.cache
def _register_exit_hooks() -> None:
    """Register, at the first facade's first use, the hook that stops its workers: with the interpreter's
    thread exit hooks, which run before ``concurrent.futures`` joins its threads, and a worker's ``def``
    handler runs in one of them. The exit would wait for that handler before an ``atexit`` hook could
    abort its ``ctx.signal``: as long as it runs, forever for one that runs until it is aborted."""
    try:
        # Imported first, so its hook (joining the pools' threads) is registered before ours and runs after it.
        importlib.import_module("concurrent.futures.thread")
        register = getattr(threading, "_register_atexit", None)
        if register is not None:  # without it (not CPython), workers stop with the runtime in the atexit hook
            register(_stop_workers_at_exit)
    except RuntimeError:  # "can't register atexit after shutdown": first used while the process exits
        pass


def _close_at_exit(facade_ref: weakref.ref[SyncRunlane]) -> None:
    """At interpreter exit, close a runtime the facade started and nobody closed (a web app's producer
    rarely has a place to call ``close()``): its connections close cleanly instead of being dropped
    with the facade's daemon thread, pending tasks and all. So is a runtime started on a loop that has
    closed since (``asyncio.run(...)`` before the facade was used): nothing else can close it, and the
    facade loop's own connections would otherwise hold up the exit. One started on a loop still open
    is that loop's to close."""
    facade = facade_ref()
    if facade is None:
        return
    loop, runtime = facade._loop, facade._runtime
    started_on = runtime._started_on
    orphaned = started_on is not None and started_on.is_closed()
    if loop is None or not runtime._started or (started_on is not loop and not orphaned):
        facade.shutdown_loop()
        return
    runtime._closed_at_exit = True
    try:
        asyncio.run_coroutine_threadsafe(runtime.close(), loop).result(timeout=_EXIT_CLOSE_S)
    except Exception:  # noqa: BLE001 - the process is exiting; there is nobody left to report to
        pass
    facade.shutdown_loop()


# How often a caller waiting on the facade loop checks that the loop is still there to answer it.
_LOOP_CHECK_S = 1.0


class _NeverRan(Exception):
    """The facade loop closed before it started a call sent to it."""


def _result_of(future: concurrent.futures.Future[T], loop: asyncio.AbstractEventLoop, coroutine: Any) -> T:
    """``future.result()``, without waiting for ever on a loop that has closed: a call sent just as
    ``close()`` (in another thread) stopped the loop is never run. One that never started raises
    ``_NeverRan``, to be asked again; one that had started is cancelled."""
    while True:
        try:
            return future.result(timeout=_LOOP_CHECK_S)
        except TimeoutError:
            if future.done() or not loop.is_closed():
                if future.done():
                    raise  # what the call itself raised
                continue
            started = inspect.getcoroutinestate(coroutine) != inspect.CORO_CREATED
            coroutine.close()
            future.cancel()
            if not started:
                raise _NeverRan() from None


class SyncRunlane:
    """Blocking versions of the runtime's methods: ``runlane.sync.trigger(task, payload)``."""

    def __init__(self, runtime: Runlane) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.runs = SyncRuns(self)
        self.signals = SyncSignals(self)
        self.idempotency_keys = SyncIdempotencyKeys(self)
        self.observations = SyncObservations(self)

    def __repr__(self) -> str:
        return f"SyncRunlane({self._runtime!r})"

    # -- the facade loop -------------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is not None:
            return loop
        if self._runtime.closed:
            # Refused before a loop is started for it: one started now would run until the process exits, a
            # thread and its selector for every closed runtime a program calls again.
            self._runtime._check_open()
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    try:
                        while True:
                            try:
                                loop.run_forever()
                            except (SystemExit, KeyboardInterrupt):
                                # Raised by code run on the loop (sys.exit() in a worker's callback): asyncio
                                # lets it stop the loop, which on this thread would end only the thread and
                                # leave every call for ever waiting on it. The task that raised it keeps it
                                # for whoever waits on that task; the loop serves on.
                                continue
                            break
                    finally:
                        loop.close()

                thread = threading.Thread(target=serve, name="runlane-sync", daemon=True)
                thread.start()
                ready.wait()
                self._thread = thread
                self._loop = loop
                _RUNNING_FACADES.add(self)
                _register_exit_hooks()
            return self._loop

    def call(self, function: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``function(*args, **kwargs)`` on the facade loop and block until it returns."""
        return self._call(function, args, kwargs, interruptible=False)

    def _call(self, function: Callable[..., Awaitable[T]], args: Any, kwargs: Any, *, interruptible: bool) -> T:
        """``call()``; ``interruptible``: a caller interrupted meanwhile (Ctrl-C) cancels it, as ``asyncio.run()``
        cancels its main task. Only for a call that does nothing but wait (``runs.wait()``, which would read
        storage until the runtime closed, for nobody): an attempt (``run_now()``) goes on, and is stopped by
        the close at exit as a worker's are, its run handed back."""
        if threading.current_thread() is self._thread:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                "runlane.sync was called from its own event-loop thread; use the async API (await runlane...) there.",
            )
        _refuse_in_event_loop()
        loop = self._ensure_loop()

        async def invoke() -> T:
            return await function(*args, **kwargs)

        coroutine = invoke()
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        except RuntimeError:
            coroutine.close()
            if not loop.is_closed() or self._loop is loop:
                raise
            # The loop was closed after this call found it (close() in another thread): ask again, which
            # refuses a closed runtime as any later call is refused.
            return self._call(function, args, kwargs, interruptible=interruptible)
        try:
            return _result_of(future, loop, coroutine)
        except _NeverRan:
            return self._call(function, args, kwargs, interruptible=interruptible)
        except concurrent.futures.CancelledError:
            raise RunlaneError(
                ErrorCode.OPERATION_CANCELLED,
                "runlane.sync was closed while this call was still running; nothing more was done for it.",
                retryable=False,
            ) from None
        except BaseException:
            if interruptible:
                future.cancel()  # the wait was interrupted (KeyboardInterrupt); a call that has ended stays as it is
            raise
        finally:
            if _exit_hook_done and self in _RUNNING_FACADES:
                # Used while the process exits, after the exit hook ran or when it could no longer be
                # registered: nothing else will close the runtime this call started.
                _close_at_exit(weakref.ref(self))

    def _stop_workers_at_exit(self, timeout: float) -> None:
        """Stop the workers on the facade loop, waiting ``timeout`` seconds at most for the attempts they
        run: as a worker stop does, their handlers see ``ctx.signal`` aborted (``worker_stopped``), and one
        that stops for it hands its run back. So do the handlers of the facade's ``run_now()``,
        ``execute_next()`` and ``execute_delivery()`` calls still running: the interpreter waits for a ``def``
        handler's thread before the runtime closes, and one waiting for its signal would hold the exit up
        for ever. The runtime stays open for threads still using it."""
        loop = self._loop
        if loop is None:
            return
        runtime = self._runtime

        async def stop() -> None:
            runtime.registry.stop_on(loop, REASON_WORKER_STOPPED)
            workers = [worker for worker in list(runtime._workers) if worker.closed.get_loop() is loop]
            await asyncio.gather(*(worker.stop() for worker in workers), return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=timeout)
        except Exception:  # noqa: BLE001 - the process is exiting; the runtime's close reports nothing either
            pass

    def forked(self) -> None:
        """In a forked child: the facade loop's thread stayed with the parent; forget that loop (the
        runtime refuses every call if it was started, else the next call starts a loop of its own)."""
        loop = self._loop
        if loop is not None:
            # Its tasks (a connection pool's workers, say) never run again here; collected at exit, each
            # would print "Task was destroyed but it is pending" for a child that did nothing wrong.
            for task in asyncio.all_tasks(loop):
                task._log_destroy_pending = False  # type: ignore[attr-defined]
        self._lock = threading.Lock()
        self._loop = None
        self._thread = None
        _RUNNING_FACADES.discard(self)

    def shutdown_loop(self) -> None:
        """Stop the facade loop thread (called when the runtime closes)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or threading.current_thread() is thread:
            return  # not started, or closing from the facade loop itself: ``close()`` stops it afterwards
        with self._lock:
            self._loop = None
            self._thread = None
        _RUNNING_FACADES.discard(self)

        async def settle() -> None:
            # Calls still running (a handler mid-attempt) finish or fail against the closed lane;
            # what outlasts the grace period is cancelled, so no caller waits on a stopped loop.
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            if pending:
                _done, late = await asyncio.wait(pending, timeout=_CLOSE_GRACE_S)
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late, timeout=1.0)

        try:
            asyncio.run_coroutine_threadsafe(settle(), loop).result(timeout=_CLOSE_GRACE_S + 2)
        except (RuntimeError, concurrent.futures.TimeoutError):
            pass
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            return
        thread.join(timeout=5)

    # -- registries ------------------------------------------------------------------------------

    @property
    def tasks(self) -> Registry[TaskDefinition]:
        return self._runtime.tasks

    @property
    def queues(self) -> Registry[QueueDefinition]:
        return self._runtime.queues

    @property
    def environment(self) -> Environment:
        return self._runtime.environment

    @property
    def lane(self) -> Lane:
        return self._runtime.lane

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the runtime (the lane's storage, then its transport); mirrors ``await runlane.start()``."""
        self.call(self._runtime.start)

    def close(self) -> None:
        """Close the runtime (workers and attempts, then the lane) and stop the facade loop; mirrors
        ``await runlane.close()``."""
        _refuse_in_event_loop()
        refuse_waiting_for_itself(self._runtime, "runlane.sync.close()")
        if self._loop is not None:
            self.call(self._runtime.close)
        else:
            asyncio.run(self._runtime.close())
        self.shutdown_loop()

    def __enter__(self) -> SyncRunlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- runtime methods -------------------------------------------------------------------------

    @_options_of(Runlane.trigger)
    def trigger(self, task: TaskDefinition | str, payload: Any = None, **options: Any) -> TriggerRunResult:
        """Validate the payload and create one durable run; mirrors ``await runlane.trigger(...)``."""
        return self.call(self._runtime.trigger, task, payload, **options)

    @_options_of(Runlane.run_now)
    def run_now(self, task: TaskDefinition | str, payload: Any = None, **options: Any) -> RunRecord:
        """Create a run and execute its first attempt in this process; mirrors ``await runlane.run_now(...)``."""
        return self.call(self._runtime.run_now, task, payload, **options)

    @_options_of(Runlane.execute_next)
    def execute_next(self, **options: Any) -> RunRecord | None:
        """Claim one due run and execute one attempt (``None`` when there was nothing to execute); mirrors
        ``await runlane.execute_next(...)``."""
        return self.call(self._runtime.execute_next, **options)

    @_options_of(Runlane.execute_delivery)
    def execute_delivery(self, message: Any, **options: Any) -> ExecuteDeliveryResult:
        """Execute the run a transport delivered, or report why it is ignored; mirrors
        ``await runlane.execute_delivery(...)``."""
        return self.call(self._runtime.execute_delivery, message, **options)

    @_options_of(Runlane.tick)
    def tick(self, **options: Any) -> TickResult:
        """Run one maintenance pass (schedules, recovery, cancellations, timeouts, outbox); mirrors
        ``await runlane.tick(...)``."""
        return self.call(self._runtime.tick, **options)

    @_options_of(Runlane.worker)
    def worker(self, **options: Any) -> SyncWorkerHandle:
        """Start a worker on the facade loop; returns a handle with blocking ``stop()`` / ``wait()``. Mirrors
        ``runlane.worker(...)``."""
        runtime = self._runtime

        async def start() -> tuple[WorkerHandle, concurrent.futures.Future[None]]:
            handle = runtime.worker(**options)
            # Watched from the loop the worker runs on (a facade used while the process exits is closed
            # at the end of this call, its loop with it).
            return handle, asyncio.run_coroutine_threadsafe(handle.wait_closed(), asyncio.get_running_loop())

        handle, closed = self.call(start)
        return SyncWorkerHandle(self, handle, closed)


class SyncWorkerHandle:
    """A worker running on the facade loop. ``closed`` is a ``concurrent.futures.Future``."""

    def __init__(self, facade: SyncRunlane, handle: WorkerHandle, closed: concurrent.futures.Future[None]) -> None:
        self._facade = facade
        self._handle = handle
        self._closed = closed

    def __repr__(self) -> str:
        return f"SyncWorkerHandle({self._handle!r})"

    @property
    def closed(self) -> concurrent.futures.Future[None]:
        return self._closed

    @property
    def executed(self) -> int:
        return self._handle.executed

    def wait(self, timeout: float | None = None) -> None:
        """Block until the worker exits (raises its failure). Refused in ``async`` code, as every facade call is:
        it would block that event loop until the worker exits."""
        _refuse_in_event_loop()
        self._closed.result(timeout)

    def stop(self) -> None:
        """Stop the worker and block until its active attempts finish (nothing to do once it has closed,
        after ``runlane.sync.close()`` say). Refused in a ``def`` handler of this worker, which it would wait
        for: checked here, in the calling thread, as the stop itself runs in a task of the facade loop."""
        if self._closed.done():
            return
        refuse_waiting_for_itself(self._facade._runtime, "worker.stop()", self._handle._stop.signal)
        self._facade.call(self._handle.stop)


class SyncRuns:
    """``runlane.sync.runs``: blocking versions of ``runlane.runs``."""

    def __init__(self, facade: SyncRunlane) -> None:
        self._facade = facade

    def get(self, run_id: str) -> RunRecord | None:
        """The run, or ``None`` when it does not exist or was pruned; mirrors ``await runlane.runs.get(...)``."""
        return self._facade.call(self._facade._runtime.runs.get, run_id)

    @_options_of(RunsApi.wait)
    def wait(self, run_id: str, **options: Any) -> RunRecord:
        """Block until the run has finished and return it; mirrors ``await runlane.runs.wait(...)``. Refused in
        the run's own ``def`` handler (checked in its thread: the wait runs in a task of the facade loop)."""
        refuse_waiting_for_its_own_run(self._facade._runtime, run_id, "runlane.sync.runs.wait()")
        return self._facade._call(self._facade._runtime.runs.wait, (run_id,), options, interruptible=True)

    @_options_of(RunsApi.list)
    def list(self, **options: Any) -> Page[RunSummary]:
        """A page of run summaries; mirrors ``await runlane.runs.list(...)``."""
        return self._facade.call(self._facade._runtime.runs.list, **options)

    @_options_of(RunsApi.events)
    def events(self, run_id: str, **options: Any) -> Page[RunEventRecord]:
        """A page of the run's event history; mirrors ``await runlane.runs.events(...)``."""
        return self._facade.call(self._facade._runtime.runs.events, run_id, **options)

    # ``builtins.list``: inside this class, ``list`` names the ``list`` method above.
    def attempts(self, run_id: str) -> builtins.list[RunAttemptSummary]:
        """The run's attempts, derived from its history; mirrors ``await runlane.runs.attempts(...)``."""
        return self._facade.call(self._facade._runtime.runs.attempts, run_id)

    def step(self, run_id: str, step_key: str) -> RunStepRecord | None:
        """What the run's durable step ``step_key`` stored, or ``None``; mirrors ``await runlane.runs.step(...)``."""
        return self._facade.call(self._facade._runtime.runs.step, run_id, step_key)

    @_options_of(RunsApi.steps)
    def steps(self, run_id: str, **options: Any) -> Page[RunStepRecord]:
        """A page of the run's completed durable steps; mirrors ``await runlane.runs.steps(...)``."""
        return self._facade.call(self._facade._runtime.runs.steps, run_id, **options)

    @_options_of(RunsApi.find_active)
    def find_active(self, **options: Any) -> RunRecord | None:
        """The active run of a task holding an idempotency or singleton key, or ``None``; mirrors
        ``await runlane.runs.find_active(...)``."""
        return self._facade.call(self._facade._runtime.runs.find_active, **options)

    @_options_of(RunsApi.find_current)
    def find_current(self, **options: Any) -> RunRecord | None:
        """The run that holds an idempotency key (active or retained), or ``None``; mirrors
        ``await runlane.runs.find_current(...)``."""
        return self._facade.call(self._facade._runtime.runs.find_current, **options)

    @_options_of(RunsApi.cancel)
    def cancel(self, run_id: str, **options: Any) -> RunRecord:
        """Cancel a waiting run, or request the cancellation of a running one; mirrors
        ``await runlane.runs.cancel(...)``."""
        return self._facade.call(self._facade._runtime.runs.cancel, run_id, **options)

    @_options_of(RunsApi.rerun)
    def rerun(self, source_run_id: str, **options: Any) -> RunRecord:
        """Create a new run from a terminal run; mirrors ``await runlane.runs.rerun(...)``."""
        return self._facade.call(self._facade._runtime.runs.rerun, source_run_id, **options)

    @_options_of(RunsApi.retry)
    def retry(self, source_run_id: str, **options: Any) -> RunRecord:
        """Create a new run from a failed run; mirrors ``await runlane.runs.retry(...)``."""
        return self._facade.call(self._facade._runtime.runs.retry, source_run_id, **options)

    @_options_of(RunsApi.prune)
    def prune(self, **options: Any) -> PruneResult:
        """Delete old terminal runs with their history; mirrors ``await runlane.runs.prune(...)``."""
        return self._facade.call(self._facade._runtime.runs.prune, **options)


class SyncSignals:
    """``runlane.sync.signals``: blocking versions of ``runlane.signals``."""

    def __init__(self, facade: SyncRunlane) -> None:
        self._facade = facade

    @_options_of(SignalsApi.send)
    def send(self, signal_key: str, **options: Any) -> list[RunRecord]:
        """Resume the runs waiting for ``signal_key`` and return them; mirrors ``await runlane.signals.send(...)``."""
        return self._facade.call(self._facade._runtime.signals.send, signal_key, **options)


class SyncIdempotencyKeys:
    """``runlane.sync.idempotency_keys``: blocking versions of ``runlane.idempotency_keys``."""

    def __init__(self, facade: SyncRunlane) -> None:
        self._facade = facade

    def reset(self, task: TaskDefinition | str, *, key: str) -> None:
        """Free the key of a finished run before its TTL; mirrors ``await runlane.idempotency_keys.reset(...)``."""
        self._facade.call(self._facade._runtime.idempotency_keys.reset, task, key=key)


class SyncObservations:
    """``runlane.sync.observations``: blocking versions of ``runlane.observations``."""

    def __init__(self, facade: SyncRunlane) -> None:
        self._facade = facade

    def scan(self, cursor: str | None = None, limit: int | None = None) -> ObservationPage:
        """Observation records after ``cursor``, in stream order; mirrors ``await runlane.observations.scan(...)``."""
        return self._facade.call(self._facade._runtime.observations.scan, cursor, limit)

    def checkpoint(self, consumer: str) -> str | None:
        """The cursor ``consumer`` last checkpointed (``None`` before its first export); mirrors
        ``await runlane.observations.checkpoint(...)``."""
        return self._facade.call(self._facade._runtime.observations.checkpoint, consumer)

    @_options_of(ObservationsApi.trim)
    def trim(self, **options: Any) -> ObservationTrimResult:
        """Delete observation records older than ``older_than``, except those a named consumer has not
        exported yet; mirrors ``await runlane.observations.trim(...)``."""
        return self._facade.call(self._facade._runtime.observations.trim, **options)
