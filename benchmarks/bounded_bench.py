"""Bounded queues with a backlog: throughput behind one busy concurrency key, and how long other keys wait.

A bounded queue (``concurrency_limit`` L per concurrency key) holds N queued no-op runs of one key
("hot"). Two measurements, each over a fresh database:

1. Backlog: a drain worker with C slots works the hot key's runs; prints runs/second. At most L of
   them run at once, so every scan passes over the rest of the backlog (the partition is full).
2. Other keys: the same backlog, then M runs spread over ten other keys, triggered last; a poll worker
   with C slots starts, and the figure is how long until every one of the M runs finished (and how
   many hot runs ran meanwhile): one tenant's flood must not hold the others' runs back.

Lanes: ``memory`` (in process), ``sqlite`` (a file in a temporary directory) and ``postgres`` (a
throwaway PostgreSQL server with durable defaults, unless ``RUNLANE_POSTGRES_BENCH_URL`` names a
database; each measurement migrates a schema of its own).

    .venv/bin/python benchmarks/bounded_bench.py [--lanes memory,sqlite,postgres] [--runs 5000]
        [--others 100] [--limit 4] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runlane import WorkerMode, create_runlane, queue, task

_schemas = itertools.count()


def _lane_factories(names: list[str], directory: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``(name, make_lane)`` per lane; each ``make_lane()`` is a lane over fresh storage."""
    for name in names:
        if name == "memory":
            from runlane_local import local_lane

            yield name, local_lane
        elif name == "sqlite":
            from runlane_local import sqlite_lane

            files = itertools.count()
            yield name, lambda: sqlite_lane(directory / f"bench-{next(files)}.db")
        elif name == "postgres":
            with _postgres() as url:
                from runlane_postgres import apply_postgres_migrations, postgres_polling_lane

                def fresh() -> Any:
                    schema = f"bounded_{next(_schemas)}"
                    asyncio.run(apply_postgres_migrations(url, schema=schema))
                    return postgres_polling_lane(url, schema=schema)

                yield name, fresh
        else:
            raise SystemExit(f"unknown lane {name!r}: use memory, sqlite or postgres")


@contextmanager
def _postgres() -> Iterator[str]:
    url = os.environ.get("RUNLANE_POSTGRES_BENCH_URL")
    if url:
        yield url
        return
    from runlane_postgres.testing import PostgresTestServer

    with PostgresTestServer() as server:
        yield server.url


def _runtime(lane: Any, limit: int, done: dict[str, int]) -> tuple[Any, Any]:
    tenants = queue("tenants", default=True, concurrency_limit=limit)

    @task("bench.tenant_work", queue=tenants)
    async def work(payload: dict) -> None:
        done[payload["tenant"]] = done.get(payload["tenant"], 0) + 1

    return create_runlane(lane=lane, queues=[tenants], tasks=[work]), work


async def _backlog(lane: Any, runs: int, limit: int, concurrency: int) -> float:
    done: dict[str, int] = {}
    runtime, work = _runtime(lane, limit, done)
    async with runtime:
        for _ in range(runs):
            await runtime.trigger(work, {"tenant": "hot"}, concurrency_key="hot")
        started = time.perf_counter()
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=concurrency).closed, 600)
        elapsed = time.perf_counter() - started
    assert done.get("hot") == runs, f"drained {done.get('hot')} of {runs} runs"
    return runs / elapsed


async def _others(lane: Any, runs: int, others: int, limit: int, concurrency: int) -> tuple[float, int]:
    done: dict[str, int] = {}
    runtime, work = _runtime(lane, limit, done)
    async with runtime:
        for _ in range(runs):
            await runtime.trigger(work, {"tenant": "hot"}, concurrency_key="hot")
        for n in range(others):
            await runtime.trigger(work, {"tenant": "other"}, concurrency_key=f"other-{n % 10}")
        started = time.perf_counter()
        worker = runtime.worker(concurrency=concurrency)
        try:
            while done.get("other", 0) < others:
                if time.perf_counter() - started > 600:
                    raise SystemExit(f"other keys: {done.get('other', 0)} of {others} runs after 600 s")
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
        finally:
            await worker.stop()
    return elapsed, done.get("hot", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", default="memory,sqlite,postgres")
    parser.add_argument("--runs", type=int, default=5000, help="queued runs of the busy key")
    parser.add_argument("--others", type=int, default=100, help="runs of ten other keys, triggered last")
    parser.add_argument("--limit", type=int, default=4, help="the queue's concurrency_limit")
    parser.add_argument("--concurrency", type=int, default=8, help="worker slots")
    args = parser.parse_args()
    print(f"bounded queue backlog (CPython {platform.python_version()}, load {os.getloadavg()[0]:.2f})")
    print(f"  {args.runs:,} runs of one key, concurrency_limit {args.limit}, workers with {args.concurrency} slots")
    with tempfile.TemporaryDirectory(prefix="runlane-bounded-") as directory:
        for name, make_lane in _lane_factories(args.lanes.split(","), Path(directory)):
            rate = asyncio.run(_backlog(make_lane(), args.runs, args.limit, args.concurrency))
            elapsed, hot = asyncio.run(_others(make_lane(), args.runs, args.others, args.limit, args.concurrency))
            print(f"  {name}:")
            print(f"    backlog:     {rate:,.0f} runs/s")
            print(f"    other keys:  {args.others} runs done in {elapsed:.2f} s", end="")
            print(f" ({hot} of the busy key's ran meanwhile)")


if __name__ == "__main__":
    main()
