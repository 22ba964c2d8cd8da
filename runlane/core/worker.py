"""Storage-acquisition workers: ``WorkerHandle`` and its poll / drain slot loops.

A worker runs ``concurrency`` slots on the event loop it was started from. Each slot repeats the
runtime's scan-claim-execute step; the slots of one worker share a candidate pool (one storage scan
feeds several claims) and the runtime's claim and completion batchers (concurrent slots share
storage transactions).

* poll: an empty scan waits ``empty_poll_delay``, or less: a trigger in this process (or any write
  that makes a run due now, or frees bounded-queue capacity) wakes idle slots at once;
* drain: a slot exits when storage has no due work; ``max_runs`` counts only executed runs, and a
  slot reserves its share of the budget before claiming so concurrent slots never overshoot it.

Transient storage failures (``storage_unavailable``, ``storage_conflict``) do not stop a worker: it
logs the first one on the ``runlane.worker`` logger, counts them (``storage_errors``, ``last_error``),
backs off (50 ms doubling to 2 s, with jitter) and logs again when storage answers. A drain worker, a
job meant to end, gives up once storage has been unavailable for ``outage_limit_s`` in a row and raises
that error from ``closed``; its attempts, which retry their heartbeats and outcome writes meanwhile,
count the same outage (see ``ExecutionOptions.outage_clock``), so the drain ends about that long after
storage was first found unavailable, whichever of them found it.

A due run whose stored record cannot be read does not stop a worker either: the runtime logs it once
(an error on ``runlane.worker``) and sets it aside, and scans pass over it for the life of the runtime.
So is a runnable-index candidate whose run claims keep finding missing or finished (a stale index row,
logged once as a warning). A slot whose claims keep coming back lost backs off (5 ms doubling to
0.5 s) after a few immediate retries instead of spinning. Any other error stops the worker and is
raised from ``closed``.

``stop()`` (or the worker's ``signal``) aborts the signal every running attempt's ``TaskContext``
is linked to, waits for those attempts to finish cooperatively, then settles ``closed``. It is not
a durable cancellation: a handler that returns normally after a stop still succeeds.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RunlaneError
from ..models import RunRecord
from ..vocabulary import WorkerMode
from .attempt import REASON_WORKER_STOPPED, ExecutionOptions, OutageClock, refuse_waiting_for_itself
from .cancellation import CancellationController, CancellationSignal
from .runtime import CandidatePool

if TYPE_CHECKING:
    from .runtime import Runlane

__all__ = ["REASON_WORKER_STOPPED", "WorkerHandle", "backoff_delay", "stopped_by"]

# A drain slot whose due work is all capacity-blocked re-checks at least this often (seconds).
_BLOCKED_RECHECK = 0.05
# Candidates one storage scan fetches per worker slot, so a scan feeds several claims.
_SCAN_PER_SLOT = 4
# Transient storage failures a worker rides out with backoff (seconds) instead of stopping.
_TRANSIENT_CODES = frozenset({ErrorCode.STORAGE_UNAVAILABLE, ErrorCode.STORAGE_CONFLICT})
_BACKOFF_START = 0.05
_BACKOFF_MAX = 2.0
# A slot whose claims keep coming back "lost" (due work it could not take) retries this many times at
# once, as a lost race with another worker is cheap to retry; then it backs off from _LOST_BACKOFF_START
# (seconds, doubling to _LOST_BACKOFF_MAX, or a wake-up) instead of spinning on storage.
_LOST_FREE_RETRIES = 3
_LOST_BACKOFF_START = 0.005
_LOST_BACKOFF_MAX = 0.5
_log = logging.getLogger("runlane.worker")


class WorkerHandle:
    """A running worker. ``closed`` settles when every slot has exited; ``await stop()`` stops it."""

    def __init__(
        self,
        runtime: Runlane,
        *,
        mode: WorkerMode,
        queues: Sequence[str],
        concurrency: int,
        empty_poll_delay: float,
        max_runs: int | None,
        options: ExecutionOptions,
        on_run_executed: Callable[[RunRecord], Any] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._runtime = runtime
        self._mode = mode
        self._queues = tuple(queues)
        self._concurrency = concurrency
        self._delay = empty_poll_delay
        self._max_runs = max_runs
        self._on_run_executed = on_run_executed
        self._stop, self._unlink_signal = stopped_by(options.signal)
        # Storage unavailable since when (loop time), as found by the slots' scans and claims, and, in a
        # drain, by its attempts' heartbeats and outcome writes: one outage, one limit.
        self._outage = OutageClock()
        drain_clock = self._outage if options.outage_limit_s is not None else None
        self._options = replace(options, signal=self._stop.signal, outage_clock=drain_clock)
        # A poll worker's idle slots share one idle scan per poll delay (see ``CandidatePool``).
        idle_window = empty_poll_delay if mode is WorkerMode.POLL else 0.0
        self._pool = CandidatePool(_SCAN_PER_SLOT * concurrency + 8, idle_window, thorough=mode is not WorkerMode.POLL)
        self._executed = 0
        self._reserved = 0
        self._failures = 0  # consecutive transient storage failures (0: healthy)
        self._storage_errors = 0
        self._last_error: RunlaneError | None = None
        self._error: BaseException | None = None
        self._loop = loop
        self._slots: list[asyncio.Task[None]] = []
        self._closed: asyncio.Future[None] = loop.create_future()
        # Failures are reported through ``closed`` / ``stop()``; this only marks the exception as seen
        # so an unobserved failed worker does not log "exception was never retrieved".
        self._closed.add_done_callback(_mark_retrieved)
        self._public_closed = self._follow_closed()  # the ``closed`` handed out (see there)
        runtime.register_worker(self)
        self._task = loop.create_task(self._run(), name=f"runlane-worker-{options.worker_id}")

    def __repr__(self) -> str:
        state = "closed" if self._closed.done() else ("stopping" if self._stop.signal.aborted else "running")
        return f"WorkerHandle(mode={self._mode.value!r}, concurrency={self._concurrency}, executed={self._executed}, {state})"

    # -- passive state ---------------------------------------------------------------------------

    @property
    def closed(self) -> asyncio.Future[None]:
        """The terminal future: settles when every slot has exited (raises the loop's failure).

        The same future every time, unless its reader cancelled it (``asyncio.wait_for(worker.closed, t)``
        timing out does): that cancels only the future handed out, never the worker's own, so the worker
        goes on, ``stop()`` still waits for it, and the next read gets a fresh future."""
        public = self._public_closed
        if public.cancelled() and not self._closed.cancelled():
            public = self._public_closed = self._follow_closed()
        return public

    def _follow_closed(self) -> asyncio.Future[None]:
        """A new future that settles as the worker's own terminal future does."""
        public: asyncio.Future[None] = self._loop.create_future()
        public.add_done_callback(_mark_retrieved)
        if self._closed.done():
            _settle(public, self._closed)
        else:
            self._closed.add_done_callback(lambda closed: _settle(public, closed))
        return public

    @property
    def executed(self) -> int:
        """Runs this worker executed (persisted an attempt outcome for)."""
        return self._executed

    @property
    def storage_errors(self) -> int:
        """Transient storage failures (``storage_unavailable`` / ``storage_conflict``) this worker rode out."""
        return self._storage_errors

    @property
    def last_error(self) -> RunlaneError | None:
        """The latest transient storage failure, kept after the worker recovers from it."""
        return self._last_error

    @property
    def mode(self) -> WorkerMode:
        return self._mode

    @property
    def stopping(self) -> bool:
        return self._stop.signal.aborted

    # -- actions ---------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Abort the worker signal without waiting (slots finish their current attempt and exit)."""
        self._stop.abort(REASON_WORKER_STOPPED)
        self._runtime.work_signal.notify()

    async def stop(self) -> None:
        """Stop the worker, wait for active attempts to finish, and return ``closed``'s result."""
        refuse_waiting_for_itself(self._runtime, "worker.stop()", self._stop.signal)
        self.refuse_in_own_slot("worker.stop()")
        self.request_stop()
        await self.wait_closed()

    def refuse_in_own_slot(self, what: str) -> None:
        """Refuse ``what`` (``stop()``, ``runlane.close()``) called by this worker's ``on_run_executed``
        callback: the callback runs in one of the worker's slots, so waiting for the worker to close would
        wait for that callback to return, for ever."""
        if asyncio.current_task() in self._slots:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"{what} was called by the worker's on_run_executed callback and would wait for that callback to "
                "return; use asyncio.create_task(...) of it, which goes on once the callback returns.",
            )

    async def wait_closed(self) -> None:
        if asyncio.get_running_loop() is self._loop:
            await asyncio.shield(self._closed)
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_wait(self._closed), self._loop))

    # -- transient storage failures ---------------------------------------------------------------

    def _report_transient(self, error: RunlaneError) -> None:
        self._storage_errors += 1
        self._last_error = error
        if self._failures == 0:
            _log.warning(
                "Worker %s: storage failed (%s: %s); retrying with backoff%s.",
                self._options.worker_id, error.code.value, error.message,
                f" (a drain gives up after {self._options.outage_limit_s:g}s without storage)"
                if self._options.outage_limit_s is not None else "",
            )  # fmt: skip
        self._failures += 1

    def _recovered(self) -> None:
        _log.warning("Worker %s: storage is reachable again after %d failures.", self._options.worker_id, self._failures)
        self._failures = 0

    def _outlasted_drain(self, error: RunlaneError) -> bool:
        """Whether a drain worker has waited out unavailable storage long enough and should fail."""
        limit = self._options.outage_limit_s  # set for drain workers
        if limit is None or error.code is not ErrorCode.STORAGE_UNAVAILABLE:
            return False
        now = self._loop.time()
        began = self._outage.down(now)
        # An attempt's error can come long after its storage write failed (a handler that ran on after its
        # heartbeats gave up): the loop looks at storage again itself before ending the drain on it.
        return self._failures > 0 and now - began >= limit

    def _backoff(self) -> float:
        """Seconds before the next try: doubling from 50 ms, capped at 2 s, with jitter."""
        return backoff_delay(self._failures, _BACKOFF_START, _BACKOFF_MAX)

    # -- loops -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = self._loop
        # Idle poll slots also wake on other processes' hints when storage offers them.
        unsubscribe = self._runtime.subscribe_wake_hints() if self._mode is WorkerMode.POLL else None
        slots = self._slots = [loop.create_task(self._slot()) for _ in range(self._concurrency)]
        try:
            pending = set(slots)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if not task.cancelled() and task.exception() is not None and self._error is None:
                        self._error = task.exception()
                        self.request_stop()  # one failed slot stops the worker; the others finish cleanly
        except asyncio.CancelledError:
            for task in slots:
                task.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            if not self._closed.done():
                self._closed.cancel()
            raise
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._runtime.unregister_worker(self)
            self._unlink_signal()
        if self._closed.done():
            return
        if self._error is not None:
            self._closed.set_exception(self._error)
        else:
            self._closed.set_result(None)
        _settle(self._public_closed, self._closed)  # now, not a loop turn later: settled once stop() returns

    async def _slot(self) -> None:
        runtime = self._runtime
        stop = self._stop.signal
        work = runtime.work_signal
        drain = self._mode is WorkerMode.DRAIN
        max_runs = self._max_runs
        queues = self._queues
        options = self._options
        pool = self._pool
        lost = 0  # consecutive "lost" steps of this slot
        while not stop.aborted and not runtime.closed:
            if max_runs is not None:
                if self._executed + self._reserved >= max_runs:
                    return
                self._reserved += 1
            generation = work.generation
            try:
                await runtime._ready()  # a worker is the first call of many programs: it starts the lane
                # A run whose record cannot be read is reported and set aside by the runtime; the worker
                # goes on with the other runs instead of stopping on it.
                run, status = await runtime.execute_one(queues, options, pool, unreadable_as_lost=True)
            except RunlaneError as error:
                if not _is_transient(error) or self._outlasted_drain(error):
                    raise
                # Storage is down or contended: report it, back off, and keep the worker alive. An
                # attempt whose outcome could not be written keeps its lease; recovery re-delivers it.
                self._report_transient(error)
                await work.wait(generation, self._backoff(), stop)
                continue
            finally:
                if max_runs is not None:
                    self._reserved -= 1
            self._outage.up()  # storage answered this step: an outage met by an attempt is over too
            if self._failures:
                self._recovered()
            lost = lost + 1 if status == "lost" else 0
            if status == "executed":
                self._executed += 1
                if self._on_run_executed is not None and run is not None:
                    result = self._on_run_executed(run)
                    if inspect.isawaitable(result):
                        await result
                continue
            if status == "lost":
                if lost > _LOST_FREE_RETRIES:
                    await work.wait(generation, _lost_backoff(lost - _LOST_FREE_RETRIES), stop)
                continue
            if status == "idle" and drain:
                return
            # Idle poll slot, or due work whose bounded-queue capacity is full: wait for a wake-up.
            timeout = self._delay if not drain else _BLOCKED_RECHECK
            if status == "blocked":
                timeout = min(timeout, _BLOCKED_RECHECK) if drain else timeout
            await work.wait(generation, timeout, stop)


def _lost_backoff(streak: int) -> float:
    """Seconds a slot waits after ``streak`` lost steps beyond its free retries, with jitter."""
    return backoff_delay(streak, _LOST_BACKOFF_START, _LOST_BACKOFF_MAX)


def backoff_delay(streak: int, start: float, maximum: float) -> float:
    """Seconds to wait after the ``streak``-th failure in a row: ``start`` doubling up to ``maximum``,
    with jitter (between half and all of it), so callers failing together do not retry together."""
    base = min(maximum, start * 2 ** min(streak - 1, 16))
    return base * (0.5 + random.random() / 2)


def _is_transient(error: RunlaneError) -> bool:
    # A worker's scan and claim are safe to repeat (storage fences every claim), so an outage is
    # worth waiting out whatever the error's own retryable flag says about the failed call.
    return error.code in _TRANSIENT_CODES


def stopped_by(*signals: CancellationSignal | None) -> tuple[CancellationController, Callable[[], None]]:
    """The stop controller of a worker or consumer given ``signals`` (``None`` for one not given), and the
    function that stops following them. Any of them aborted stops it as ``stop()`` does, whatever reason it
    was aborted with: a handler that raises on ``ctx.signal`` hands its run back (``worker_stopped``) instead
    of failing it, and the run goes on at once elsewhere without spending its retry budget."""
    controller = CancellationController()
    unlinks = [
        signal.add_callback(lambda: controller.abort(REASON_WORKER_STOPPED)) for signal in signals if signal is not None
    ]

    def unlink() -> None:
        for each in unlinks:
            each()

    return controller, unlink


def _settle(target: asyncio.Future[None], source: asyncio.Future[None]) -> None:
    """Settle ``target`` as ``source`` settled (unless a reader has cancelled ``target`` meanwhile)."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        target.set_exception(error)
    else:
        target.set_result(None)


def _mark_retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


async def _wait(future: asyncio.Future[None]) -> None:
    await asyncio.shield(future)
