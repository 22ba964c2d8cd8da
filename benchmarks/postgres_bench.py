"""Runlane on PostgreSQL: burn-down, trigger throughput and trigger-to-start latency.

Starts a throwaway PostgreSQL 15 server with durable defaults (fsync and synchronous_commit on)
unless ``RUNLANE_POSTGRES_BENCH_URL`` names a database to use, applies the migration to a fresh
schema per measurement, and prints the server settings it ran under.

1. Burn-down: N pre-triggered no-op runs drained by P worker processes with C slots each
   (processes start, connect and wait at a barrier; the clock runs from the barrier to the last
   exit). Prints runs/second.
2. Trigger throughput: K producers (asyncio tasks of one process) each triggering sequentially for
   a fixed number of runs. Prints triggers/second per producer count.
3. Latency: one idle poll worker process (default empty_poll_delay, LISTEN/NOTIFY wake hints);
   runs are triggered one at a time with idle gaps; the handler records when it starts. Prints
   p50/p99 from just before ``trigger()`` to the handler's first line.

    .venv/bin/python benchmarks/postgres_bench.py [--runs 20000] [--processes 2] [--concurrency 16]
        [--producers 1,4,8] [--triggers 2000] [--latency-samples 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from runlane import WorkerMode, create_runlane, queue, task

bench_queue = queue("bench", default=True)
_latency_log: list[str] = []


@task("bench.noop", queue=bench_queue)
async def noop(payload: dict) -> None:
    if "sent" in payload:
        started = time.time()
        with open(_latency_log[0], "a") as log:
            log.write(f"{started - payload['sent']:.6f}\n")
    return None


def lane(url: str):
    from runlane_postgres import postgres_polling_lane

    return postgres_polling_lane(url)


# ---------------------------------------------------------------------------------------------
# Worker processes


async def _worker_process(url: str, mode: str, concurrency: int) -> None:
    runtime = create_runlane(lane=lane(url), queues=[bench_queue], tasks=[noop], worker_id=f"bench-{os.getpid()}")
    async with runtime:
        # Warm the pool before the barrier so connection setup is not measured.
        await runtime.runs.list(limit=1)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the barrier
        if mode == "drain":
            worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=concurrency)
            await worker.closed
            print(json.dumps({"executed": worker.executed, "finished": time.time()}), flush=True)
        else:
            worker = runtime.worker(mode=WorkerMode.POLL, concurrency=concurrency)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # stop
            await worker.stop()
            print(json.dumps({"executed": worker.executed, "finished": time.time()}), flush=True)


def _spawn(url: str, mode: str, concurrency: int, log: str = "") -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--role", "worker", "--url", url, "--mode", mode, "--concurrency", str(concurrency)]
    if log:
        command += ["--latency-log", log]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return process


def _await_ready(processes: list[subprocess.Popen[str]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        assert process.stdout is not None
        line = process.stdout.readline()  # blocks until ready (the process prints it after connecting)
        if line.strip() != "ready" or time.monotonic() > deadline:
            raise RuntimeError(f"a worker process failed to start: {line!r}")


def _release(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()


def _results(processes: list[subprocess.Popen[str]], timeout: float) -> list[dict]:
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=timeout)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


# ---------------------------------------------------------------------------------------------
# Measurements


async def _trigger(url: str, runs: int, producers: int, payload: dict | None = None) -> float:
    runtime = create_runlane(lane=lane(url), queues=[bench_queue], tasks=[noop])
    async with runtime:
        await runtime.runs.list(limit=1)
        share = [runs // producers + (1 if index < runs % producers else 0) for index in range(producers)]

        async def produce(count: int) -> None:
            for n in range(count):
                await runtime.trigger(noop, payload or {"n": n})

        started = time.perf_counter()
        await asyncio.gather(*(produce(count) for count in share))
        return runs / (time.perf_counter() - started)


def burn_down(url: str, runs: int, processes: int, concurrency: int) -> tuple[float, float]:
    trigger_rate = asyncio.run(_trigger(url, runs, 8))
    workers = [_spawn(url, "drain", concurrency) for _ in range(processes)]
    try:
        _await_ready(workers)
        started = time.time()
        _release(workers)
        results = _results(workers, timeout=900)
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
    executed = sum(result["executed"] for result in results)
    assert executed == runs, f"drained {executed} of {runs} runs"
    return runs / (max(result["finished"] for result in results) - started), trigger_rate


def latency(url: str, samples: int, log: Path) -> tuple[float, float, float]:
    worker = _spawn(url, "poll", 1, str(log))
    try:
        _await_ready([worker])
        _release([worker])
        time.sleep(0.5)  # the worker is polling and listening, idle

        async def produce() -> None:
            runtime = create_runlane(lane=lane(url), queues=[bench_queue], tasks=[noop])
            async with runtime:
                await runtime.runs.list(limit=1)
                for _ in range(samples):
                    await runtime.trigger(noop, {"sent": time.time()})
                    await asyncio.sleep(0.02)  # let the worker go idle again

        asyncio.run(produce())
        deadline = time.monotonic() + 30
        while (not log.exists() or len(log.read_text().splitlines()) < samples) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.stdin is not None
        worker.stdin.write("stop\n")
        worker.stdin.flush()
        worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    values = sorted(float(line) * 1000 for line in log.read_text().splitlines())
    assert len(values) == samples, f"{len(values)} of {samples} latency samples"
    return statistics.median(values), values[int(len(values) * 0.99) - 1], values[-1]


# ---------------------------------------------------------------------------------------------


async def _settings(url: str) -> dict[str, str]:
    import psycopg

    names = ["server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_level", "shared_buffers", "max_connections"]
    async with await psycopg.AsyncConnection.connect(url, connect_timeout=10) as connection:
        values = {}
        for name in names:
            row = await (await connection.execute(f"SHOW {name}")).fetchone()
            values[name] = row[0]
        return values


async def _fresh_schema(url: str) -> str:
    from runlane_postgres import apply_postgres_migrations

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    await apply_postgres_migrations(url, schema=schema)
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}schema={schema}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--producers", default="1,4,8")
    parser.add_argument("--triggers", type=int, default=2000)
    parser.add_argument("--latency-samples", type=int, default=300)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="drain", help=argparse.SUPPRESS)
    parser.add_argument("--latency-log", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        if args.latency_log:
            _latency_log.append(args.latency_log)
        asyncio.run(_worker_process(args.url, args.mode, args.concurrency))
        return

    server = None
    url = os.environ.get("RUNLANE_POSTGRES_BENCH_URL")
    if url is None:
        from runlane_postgres.testing import PostgresTestServer

        server = PostgresTestServer()
        server.start()
        url = server.url
    try:
        settings = asyncio.run(_settings(url))
        print(f"postgres_bench: Python {platform.python_version()}, {os.cpu_count()} CPUs, PostgreSQL settings:")
        print("  " + ", ".join(f"{name}={value}" for name, value in settings.items()))
        rate, trigger_rate = burn_down(asyncio.run(_fresh_schema(url)), args.runs, args.processes, args.concurrency)
        print(
            f"  burn-down: {args.runs} pre-triggered no-op runs, {args.processes} worker processes x "
            f"{args.concurrency} slots: {rate:,.0f} runs/s (pre-trigger with 8 producers: {trigger_rate:,.0f}/s)"
        )
        for producers in (int(value) for value in args.producers.split(",")):
            rate = asyncio.run(_trigger(asyncio.run(_fresh_schema(url)), args.triggers, producers))
            print(f"  trigger: {producers} producer(s), {args.triggers} runs: {rate:,.0f} triggers/s")
        log = Path(f"/tmp/runlane-bench-latency-{uuid.uuid4().hex[:8]}.log")
        try:
            p50, p99, worst = latency(asyncio.run(_fresh_schema(url)), args.latency_samples, log)
        finally:
            log.unlink(missing_ok=True)
        print(
            f"  trigger-to-start with an idle poll worker (separate process, {args.latency_samples} samples): "
            f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.2f} ms"
        )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
