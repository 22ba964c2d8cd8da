"""Runlane on the embedded SQLite lane: trigger throughput and drain throughput over one file.

Creates a fresh database file in a temporary directory (removed afterwards), triggers N no-op runs
(sequentially from one producer, then concurrently from P producers), drains them with a drain
worker of C slots, and prints runs/second with the journal and synchronous settings in use.

    .venv/bin/python benchmarks/sqlite_bench.py [--runs 3000] [--producers 8] [--concurrency 8]
        [--synchronous full|normal]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sqlite3
import tempfile
import time

from runlane_local import sqlite_lane

from runlane import WorkerMode, create_runlane, queue, task

bench_queue = queue("bench", default=True)


@task("bench.noop", queue=bench_queue)
async def noop(payload: dict) -> None:
    return None


async def measure(path: str, runs: int, producers: int, concurrency: int, synchronous: str) -> dict[str, float]:
    runtime = create_runlane(lane=sqlite_lane(path, synchronous=synchronous), queues=[bench_queue], tasks=[noop])
    async with runtime:
        started = time.perf_counter()
        for index in range(runs):
            await runtime.trigger(noop, {"n": index})
        sequential = runs / (time.perf_counter() - started)

        async def produce(first: int) -> None:
            for index in range(first, runs, producers):
                await runtime.trigger(noop, {"n": index})

        started = time.perf_counter()
        await asyncio.gather(*(produce(first) for first in range(producers)))
        concurrent = runs / (time.perf_counter() - started)

        executed = 0

        def count(_run: object) -> None:
            nonlocal executed
            executed += 1

        started = time.perf_counter()
        await runtime.worker(mode=WorkerMode.DRAIN, concurrency=concurrency, on_run_executed=count).closed
        drained = executed / (time.perf_counter() - started)
    if executed != 2 * runs:
        raise RuntimeError(f"drained {executed} of {2 * runs} runs")
    return {"sequential": sequential, "concurrent": concurrent, "drain": drained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--synchronous", default="full", choices=["full", "normal"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="runlane-sqlite-bench-") as directory:
        path = os.path.join(directory, "runlane.db")
        figures = asyncio.run(measure(path, args.runs, args.producers, args.concurrency, args.synchronous))
        with sqlite3.connect(path) as connection:
            journal = connection.execute("PRAGMA journal_mode").fetchone()[0]
    print(
        f"runtime on the SQLite lane ({platform.python_implementation()} {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}, journal_mode={journal}, synchronous={args.synchronous}, {os.cpu_count()} CPUs)"
    )
    print(f"  trigger, 1 producer:          {figures['sequential']:8,.0f} runs/s  ({args.runs:,} runs)")
    print(f"  trigger, {args.producers} producers:         {figures['concurrent']:8,.0f} runs/s  ({args.runs:,} runs)")
    print(f"  drain, {args.concurrency} slots:               {figures['drain']:8,.0f} runs/s  ({2 * args.runs:,} runs)")


if __name__ == "__main__":
    main()
