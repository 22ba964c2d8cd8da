"""Runlane on the embedded SQLite lane: trigger throughput and drain throughput over one file.

Creates a fresh database file in a temporary directory (removed afterwards), triggers N no-op runs
(sequentially from one producer, then concurrently from P producers), drains them with a drain
worker of C slots, and prints runs/second with the journal and synchronous settings in use. Then
the trigger-to-start latency across processes: an idle poll worker in another process (default
``empty_poll_delay``), woken by the commit itself, and runs triggered here one at a time, 20 ms
apart; prints p50/p99 from just before ``trigger()`` to the handler's first line. Then how soon another
connection's watcher hears of a trigger's commit (what wakes idle workers of other processes): p50/p99
from ``trigger()`` returning to the watcher's callback (negative: it heard first).

    .venv/bin/python benchmarks/sqlite_bench.py [--runs 3000] [--producers 8] [--concurrency 8]
        [--synchronous full|normal] [--latency-samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import selectors
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from runlane_local import sqlite_lane, sqlite_storage

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


@task("bench.latency", queue=bench_queue)
async def record_start(payload: dict) -> None:
    started = time.time()
    with open(payload["log"], "a") as log:
        log.write(f"{payload['i']} {started - payload['sent']:.6f}\n")
    print(f"started {payload['i']}", flush=True)  # the producer waits for this line, blocked


async def _latency_worker(path: str, synchronous: str) -> None:
    lane = sqlite_lane(path, synchronous=synchronous)
    runtime = create_runlane(lane=lane, queues=[bench_queue], tasks=[noop, record_start])
    async with runtime:
        worker = runtime.worker(mode=WorkerMode.POLL)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told to stop
        await worker.stop()


def _read_line(stream: Any, timeout: float) -> str:
    """The next line of a child's stdout, waiting at most ``timeout`` seconds ("" when none came)."""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout):
            return ""
    return stream.readline()


def latency(path: str, samples: int, synchronous: str, log: Path) -> tuple[float, float]:
    """(p50, p99) ms from just before ``trigger()`` here to the handler's first line in the worker process."""
    command = [sys.executable, __file__, "--role", "worker", "--path", path, "--synchronous", synchronous]
    worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdin is not None
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("the latency worker process did not start")
        time.sleep(0.3)  # it has scanned once and waits

        async def produce() -> None:
            lane = sqlite_lane(path, synchronous=synchronous)
            async with create_runlane(lane=lane, queues=[bench_queue], tasks=[noop, record_start]) as runtime:
                for index in range(samples):
                    await runtime.trigger(record_start, {"i": index, "sent": time.time(), "log": str(log)})
                    line = await asyncio.get_running_loop().run_in_executor(None, _read_line, worker.stdout, 10.0)
                    if line.strip() != f"started {index}":
                        raise RuntimeError(f"latency sample {index} never started (the worker said {line!r})")
                    await asyncio.sleep(0.02)

        log.touch()
        asyncio.run(produce())
        worker.stdin.write("stop\n")
        worker.stdin.flush()
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
    return _p50_p99([float(line.split()[1]) * 1000 for line in log.read_text().splitlines()])


def _p50_p99(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[max(0, int(len(ordered) * 0.99) - 1)]


async def hint_delays(path: str, samples: int, synchronous: str) -> tuple[float, float]:
    """(p50, p99) ms from ``trigger()`` returning to another connection's wake-hint watcher hearing of it
    (negative: it heard before ``trigger()`` returned)."""
    heard = threading.Event()
    heard_at = 0.0

    def on_hint(_queue: str) -> None:
        nonlocal heard_at
        heard_at = time.perf_counter()
        heard.set()

    watcher = sqlite_storage(path, synchronous=synchronous)
    await watcher.start()
    delays: list[float] = []
    try:
        unsubscribe = watcher.subscribe_wake_hints(on_hint)
        lane = sqlite_lane(path, synchronous=synchronous)
        loop = asyncio.get_running_loop()
        async with create_runlane(lane=lane, queues=[bench_queue], tasks=[noop]) as runtime:
            for index in range(samples):
                heard.clear()
                await runtime.trigger(noop, {"i": index})
                returned = time.perf_counter()
                if not await loop.run_in_executor(None, heard.wait, 10.0):
                    raise RuntimeError(f"the commit of trigger {index} was never heard")
                delays.append((heard_at - returned) * 1000)
                await asyncio.sleep(0.02)
        unsubscribe()
    finally:
        await watcher.close()
    return _p50_p99(delays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--synchronous", default="full", choices=["full", "normal"])
    parser.add_argument("--latency-samples", type=int, default=200, help="0 skips the latency measurement")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        asyncio.run(_latency_worker(args.path, args.synchronous))
        return
    with tempfile.TemporaryDirectory(prefix="runlane-sqlite-bench-") as directory:
        path = os.path.join(directory, "runlane.db")
        figures = asyncio.run(measure(path, args.runs, args.producers, args.concurrency, args.synchronous))
        with sqlite3.connect(path) as connection:
            journal = connection.execute("PRAGMA journal_mode").fetchone()[0]
        measured = None
        hints = None
        if args.latency_samples > 0:
            measured = latency(path, args.latency_samples, args.synchronous, Path(directory, "latency.log"))
            hints = asyncio.run(hint_delays(path, args.latency_samples, args.synchronous))
    print(
        f"runtime on the SQLite lane ({platform.python_implementation()} {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}, journal_mode={journal}, synchronous={args.synchronous}, {os.cpu_count()} CPUs)"
    )
    print(f"  trigger, 1 producer:          {figures['sequential']:8,.0f} runs/s  ({args.runs:,} runs)")
    print(f"  trigger, {args.producers} producers:         {figures['concurrent']:8,.0f} runs/s  ({args.runs:,} runs)")
    print(f"  drain, {args.concurrency} slots:               {figures['drain']:8,.0f} runs/s  ({2 * args.runs:,} runs)")
    if measured is not None:
        p50, p99 = measured
        print(
            f"  trigger-to-start, idle poll worker in another process: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
            f"({args.latency_samples} samples, 20 ms apart, default empty_poll_delay)"
        )
    if hints is not None:
        p50, p99 = hints
        print(
            f"  another connection's watcher hearing of a trigger, after trigger() returned (negative: before it): "
            f"p50 {p50:.2f} ms, p99 {p99:.2f} ms"
        )


if __name__ == "__main__":
    main()
