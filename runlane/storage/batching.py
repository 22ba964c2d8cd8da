"""Group commit: independent requests submitted close together share one ``flush`` call.

Callers ``await batcher.submit(request)``. Requests submitted in the same event-loop turn, and
those submitted while a flush is in flight, are combined into the next call of the async
``flush(requests) -> results`` function. Each caller gets its own result; a result that is an
exception instance is raised to that caller only, and an exception raised by ``flush`` itself goes
to every caller of that batch. A ``StorageLimitError`` from ``flush`` means nothing was written, so
the batch is halved and each half flushed again, down to single requests.

This module knows nothing about storage beyond ``StorageLimitError``; core's claim and completion
paths and the SQLite driver's group commit are its flush functions.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from ..errors import ErrorCode, RunlaneError
from .types import StorageLimitError

__all__ = ["Batcher", "FlushFunction"]

RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")

FlushFunction = Callable[[list[RequestT]], Awaitable[Sequence[ResultT | BaseException]]]


class Batcher(Generic[RequestT, ResultT]):
    """Combines concurrent ``submit`` calls into batched ``flush`` calls.

    ``max_batch_size`` caps one flush; ``max_concurrent_flushes`` is how many flushes may be in
    flight at once (1 gives classic group commit: the next batch forms while the current one
    commits). A caller cancelled before its request is flushed is dropped from the batch; once the
    flush started, the request completes without that caller.
    """

    def __init__(
        self,
        flush: FlushFunction[RequestT, ResultT],
        *,
        max_batch_size: int = 64,
        max_concurrent_flushes: int = 1,
    ) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_concurrent_flushes", max_concurrent_flushes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID, f"{name} must be a positive integer, got {value!r}."
                )
        self._flush = flush
        self._max_batch_size = max_batch_size
        self._max_concurrent = max_concurrent_flushes
        self._pending: deque[tuple[RequestT, asyncio.Future[ResultT]]] = deque()
        self._runners: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pending(self) -> int:
        """Requests waiting for a flush (not counting those in flight)."""
        return len(self._pending)

    async def submit(self, request: RequestT) -> ResultT:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A batcher follows the loop it is used from; a new loop starts with a clean slate.
            self._loop = loop
            self._pending.clear()
            self._runners.clear()
        future: asyncio.Future[ResultT] = loop.create_future()
        self._pending.append((request, future))
        if len(self._runners) < self._max_concurrent:
            # The runner's first step is queued behind every callback already ready in this turn,
            # so requests submitted by them join the same batch.
            self._runners.add(loop.create_task(self._run()))
        return await future

    async def _run(self) -> None:
        pending = self._pending
        try:
            while pending:
                batch: list[tuple[RequestT, asyncio.Future[ResultT]]] = []
                while pending and len(batch) < self._max_batch_size:
                    item = pending.popleft()
                    if not item[1].done():  # a caller cancelled before the flush is dropped
                        batch.append(item)
                if batch:
                    await self._deliver(batch)
        except asyncio.CancelledError:  # the runner itself was cancelled (loop shutdown)
            while pending:
                pending.popleft()[1].cancel()
            raise
        finally:
            # Synchronously, with no await since ``pending`` was seen empty: a submit can never find
            # a finished runner still counted and leave its request without one.
            self._runners.discard(asyncio.current_task())

    async def _deliver(self, batch: list[tuple[RequestT, asyncio.Future[ResultT]]]) -> None:
        try:
            results = await self._flush_split([request for request, _ in batch])
        except asyncio.CancelledError:
            for _, future in batch:
                if not future.done():
                    future.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - the flush failed as a whole: every caller of the batch gets it
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _flush_split(self, requests: list[RequestT]) -> list[ResultT | BaseException]:
        try:
            results = list(await self._flush(requests))
        except StorageLimitError as error:
            if len(requests) == 1:
                return [error]
            middle = len(requests) // 2
            return [*await self._flush_split(requests[:middle]), *await self._flush_split(requests[middle:])]
        if len(results) != len(requests):
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"A batch flush returned {len(results)} results for {len(requests)} requests.",
            )
        return results
