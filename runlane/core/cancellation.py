"""Cooperative cancellation: ``CancellationSignal`` (read side) and ``CancellationController`` (write side).

The runtime aborts a signal when cancellation is requested, an attempt deadline passes or a worker
stops; user code observes it. Handlers run on the event loop (``async def``) or in worker threads
(``def``), so every method is thread-safe: a signal can be aborted from any thread, and coroutines
awaiting ``wait()`` on any event loop are woken through ``loop.call_soon_threadsafe``.

This module owns only the signal mechanics; it knows nothing about runs, leases or storage.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from ..errors import ErrorCode, RunlaneError

__all__ = ["CancellationController", "CancellationSignal", "being_cancelled", "link_signals"]

_logger = logging.getLogger("runlane")


def being_cancelled() -> bool:
    """Whether the running task is being cancelled, so a ``CancelledError`` it meets is its own, as opposed
    to code it called (a handler, an observer, a sink) letting the cancellation of something else escape."""
    current = asyncio.current_task()
    return current is None or current.cancelling() > 0


class CancellationSignal:
    """Whether an operation should stop, and why. Obtain one from a ``CancellationController``.

    * ``aborted`` / ``reason`` / ``raise_if_aborted()`` for polling checks;
    * ``await signal.wait()`` in coroutines, ``signal.wait_sync(timeout)`` in threads;
    * ``add_callback(fn)`` to react once, in the aborting thread.

    Cheap to create: the thread event, callback table and waiter table are made on first use (most
    signals are never waited on), and a signal holds no reference back to its controller.
    """

    __slots__ = ("_aborted", "_callbacks", "_event", "_lock", "_reason", "_sync_waiters", "_waiters", "_waits")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aborted = False
        self._event: threading.Event | None = None
        self._reason: str | None = None
        # Keyed by a fresh token so the same function can be added twice and removed independently.
        self._callbacks: dict[object, Callable[[], object]] | None = None
        self._waiters: dict[asyncio.Future[None], asyncio.AbstractEventLoop] | None = None
        self._sync_waiters = 0  # threads in ``wait_sync()``
        self._waits = 0  # ``wait()`` and ``wait_sync()`` calls that began waiting

    def __repr__(self) -> str:
        state = f"aborted, reason={self._reason!r}" if self.aborted else "active"
        return f"CancellationSignal({state})"

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def reason(self) -> str | None:
        """Why the signal was aborted (``None`` while active or when no reason was given)."""
        return self._reason

    def raise_if_aborted(self) -> None:
        """Raise ``RunlaneError(operation_cancelled)`` when the signal has been aborted."""
        if self._aborted:
            reason = self._reason
            detail = f": {reason}" if reason else ""
            raise RunlaneError(
                ErrorCode.OPERATION_CANCELLED,
                f"The operation was cancelled{detail}.",
                meta={} if reason is None else {"reason": reason},
            )

    async def wait(self) -> None:
        """Return once the signal is aborted (immediately when it already is)."""
        if self._aborted:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._aborted:
                return
            if self._waiters is None:
                self._waiters = {}
            self._waiters[future] = loop
            self._waits += 1
        try:
            await future
        finally:
            with self._lock:
                if self._waiters is not None:
                    self._waiters.pop(future, None)

    def wait_sync(self, timeout: float | None = None) -> bool:
        """Block the calling thread until aborted or ``timeout`` seconds pass; returns ``aborted``."""
        with self._lock:
            if self._aborted:
                return True
            event = self._event
            if event is None:
                event = self._event = threading.Event()
            self._sync_waiters += 1
            self._waits += 1
        try:
            return event.wait(timeout)
        finally:
            with self._lock:
                self._sync_waiters -= 1

    def _waited_on(self) -> int | None:
        """Whether a coroutine (``wait()``) or a thread (``wait_sync()``) waits for this signal right now, as
        the number of waits begun so far (which changes when a wait ends and another begins), else ``None``:
        for ``runlane.testing.run_until_idle``, which moves the clock to end an attempt waiting for it."""
        with self._lock:
            return self._waits if self._waiters or self._sync_waiters > 0 else None

    def add_callback(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback()`` once when the signal aborts; returns a function that removes it.

        The callback runs in the thread that aborts the signal, or right away in the caller's thread
        when the signal is already aborted. Exceptions it raises are logged and never stop the abort.
        """
        if not callable(callback):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"add_callback() needs a function, got {callback!r}.")
        token = object()
        with self._lock:
            if not self._aborted:
                if self._callbacks is None:
                    self._callbacks = {}
                self._callbacks[token] = callback
                return lambda: self._remove_callback(token)
        _run_callback(callback)
        return _nothing_to_remove

    def _remove_callback(self, token: object) -> None:
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.pop(token, None)

    def _abort(self, reason: str | None) -> bool:
        with self._lock:
            if self._aborted:
                return False
            self._reason = reason  # written before the flag so a reader that sees aborted sees the reason
            self._aborted = True
            if self._event is not None:
                self._event.set()
            callbacks = () if self._callbacks is None else list(self._callbacks.values())
            waiters = () if self._waiters is None else list(self._waiters.items())
            self._callbacks = self._waiters = None
        for future, loop in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:
                pass  # the loop is closed, so nothing is left awaiting this future
        for callback in callbacks:
            _run_callback(callback)
        return True


class CancellationController:
    """Owns a ``CancellationSignal`` and is the only way to abort it."""

    __slots__ = ("_signal", "_unlinks")

    def __init__(self) -> None:
        self._signal = CancellationSignal()
        self._unlinks: list[Callable[[], None]] | None = None

    def __repr__(self) -> str:
        return f"CancellationController({self._signal!r})"

    @property
    def signal(self) -> CancellationSignal:
        return self._signal

    def abort(self, reason: str | None = None) -> bool:
        """Abort the signal; returns ``False`` when it was already aborted (the first reason is kept).

        An aborted linked signal stops following its parents (``unlink``) right away.
        """
        if reason is not None and not isinstance(reason, str):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"An abort reason must be a string, got {reason!r}.")
        aborted = self._signal._abort(reason)
        if aborted:
            self.unlink()
        return aborted

    def unlink(self) -> None:
        """Stop following the parent signals given to ``link_signals`` (call it when the linked scope ends)."""
        unlinks, self._unlinks = self._unlinks, None
        if unlinks:
            for remove in unlinks:
                remove()


def link_signals(*signals: CancellationSignal | None) -> CancellationController:
    """A controller whose signal aborts, with the parent's reason, as soon as any parent aborts.

    ``None`` entries are skipped. The parents hold a callback until the child aborts or ``unlink()``
    is called, so call ``unlink()`` when a short-lived child outlives its use.
    """
    controller = CancellationController()
    unlinks: list[Callable[[], None]] = []
    controller._unlinks = unlinks
    for parent in signals:
        if parent is None:
            continue
        if not isinstance(parent, CancellationSignal):
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID, f"link_signals() takes CancellationSignal values, got {parent!r}."
            )
        # A parent that is already aborted runs the callback right away: the child aborts (and
        # unlinks) before the loop goes on, and later parents are linked to an aborted child only
        # through removal functions that are never needed.
        def follow(parent: CancellationSignal = parent) -> bool:
            return controller.abort(parent.reason)

        remove = parent.add_callback(follow)
        if controller._unlinks is None:  # aborted (and unlinked) by that parent already
            remove()
        else:
            unlinks.append(remove)
    return controller


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _run_callback(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        _logger.exception("A cancellation callback raised; the signal is aborted regardless.")


def _nothing_to_remove() -> None:
    return None
