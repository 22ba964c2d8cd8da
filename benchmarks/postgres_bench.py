"""Runlane on PostgreSQL: burn-down, trigger throughput and trigger-to-start latency.

Starts a throwaway PostgreSQL 15 server with durable defaults (fsync and synchronous_commit on)
unless ``RUNLANE_POSTGRES_BENCH_URL`` names a database to use, applies the migration to a fresh
schema per measurement, and prints the server settings it ran under.

1. Burn-down: N pre-triggered no-op runs drained by P worker processes with C slots each
   (processes start, connect and wait at a barrier; the clock runs from the barrier to the last
   exit). Prints runs/second; several comma-separated C values give one burn-down each (more slots
   let one claim or outcome commit take more runs at once).
2. Trigger throughput: K producers (asyncio tasks of one process) each triggering sequentially for
   a fixed number of runs. Prints triggers/second per producer count.
3. Latency: one idle poll worker process (default empty_poll_delay, LISTEN/NOTIFY wake hints);
   runs are triggered one at a time, each once the worker has finished the previous run, either at
   once ("back to back") or after a pause; the handler records when it starts. Prints p50/p99 from
   just before ``trigger()`` to the handler's first line, and where that time goes: ``trigger()``
   itself (the commit), from its return to the wake hint reaching the worker, and from the hint to
   the handler's first line (the worker's scan and claim). Each pause also prints the floor this
   machine sets: a plain ``SELECT 1`` round trip on a connection left idle for as long.

Every throughput figure also shows the cost per run: Python CPU of the measured processes,
PostgreSQL CPU (server processes, when the server runs on this machine and its processes are
readable), and the server's transaction commits and WAL syncs (``pg_stat_database`` / ``pg_stat_wal``).
The load average is printed before each measurement: other work on the machine skews every figure.

``--statements`` adds where the server's execution time goes per run, statement by statement,
including those the commit functions run (``pg_stat_statements``: the throwaway server preloads it;
a server named by ``RUNLANE_POSTGRES_BENCH_URL`` must have it in ``shared_preload_libraries``).

    .venv/bin/python benchmarks/postgres_bench.py [--runs 20000] [--processes 2] [--concurrency 16,64]
        [--producers 1,4,8] [--triggers 2000] [--latency-samples 300] [--pauses 0,0.02]
        [--only burn,trigger,latency]
        [--setting name=value ...] [--statements]
"""

from __future__ import annotations

import argparse
import bisect
import asyncio
import json
import os
import platform
import re
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runlane import WorkerMode, create_runlane, queue, task

bench_queue = queue("bench", default=True)
_latency_log: list[str] = []
# A latency worker's log lines not written yet: the hint and the handler's start are kept in memory
# and written once the run has finished, so no file is opened inside the measured path.
_unwritten: list[str] = []

WORKER_TIMEOUT = 900.0  # seconds any one worker process may take, start-up included
READY_TIMEOUT = 60.0


@task("bench.noop", queue=bench_queue)
async def noop(payload: dict) -> None:
    if "sent" in payload:
        started = time.time()
        _unwritten.append(f"start {payload['i']} {started - payload['sent']:.6f} {started:.6f}\n")
    return None


def lane(url: str):
    from runlane_postgres import postgres_polling_lane

    return postgres_polling_lane(url)


# ---------------------------------------------------------------------------------------------
# Cost accounting: process CPU, server CPU, commits and WAL syncs


def _process_cpu(pid: int, *, children: bool = False) -> float | None:
    """CPU seconds (user + system) of ``pid``, plus its reaped children's when ``children``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    used = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        used += int(fields[13]) + int(fields[14])  # cutime, cstime
    return used / ticks


def _server_cpu(postmaster: int | None) -> float | None:
    """CPU seconds of a local server: the postmaster, its reaped backends and its live children."""
    if postmaster is None:
        return None
    total = _process_cpu(postmaster, children=True)
    if total is None:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            total += _process_cpu(int(entry.name)) or 0.0
    return total


# ``pg_stat_statements`` by (query id, top level): (text, calls, execution milliseconds so far).
Statements = dict[tuple[int, bool], tuple[str, int, float]]

# What the throwaway server needs for ``--statements``: every statement, nested ones included.
STATEMENT_SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}


@dataclass
class Counters:
    server_cpu: float | None
    commits: int
    rollbacks: int
    wal_syncs: int | None
    wal_bytes: int | None
    statements: Statements | None = None


class Meter:
    """Server-side counters sampled around a measurement."""

    def __init__(self, url: str, postmaster: int | None, *, statements: bool = False) -> None:
        self.url = url
        self.postmaster = postmaster
        self.statements = statements

    def sample(self) -> Counters:
        import psycopg

        with psycopg.connect(self.url, connect_timeout=10, autocommit=True) as connection:
            commits, rollbacks = connection.execute(
                "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
            try:
                syncs, size = connection.execute("SELECT wal_sync, wal_bytes FROM pg_stat_wal").fetchone()
            except psycopg.Error:
                syncs = size = None
            statements = _statements(connection) if self.statements else None
        return Counters(
            _server_cpu(self.postmaster), commits, rollbacks, syncs, None if size is None else int(size), statements
        )

    def settle(self) -> Counters:
        # Backends report their statistics when they exit or go idle (at most about once a second).
        time.sleep(1.1)
        return self.sample()


def _cost(
    count: int, before: Counters, after: Counters, python_cpu: float | None, *, this_process: bool = False
) -> str:
    """Per-run cost line: Python CPU, server CPU, commits and WAL syncs per run."""
    parts = []
    if python_cpu is not None:
        parts.append(f"Python CPU {python_cpu / count * 1e6:,.0f} us")
    if before.server_cpu is not None and after.server_cpu is not None:
        server = after.server_cpu - before.server_cpu
        if this_process:
            server = max(server, 0.0)
        parts.append(f"PostgreSQL CPU {server / count * 1e6:,.0f} us")
    # The meter's own connection commits a few statements: negligible next to thousands of runs.
    parts.append(f"{(after.commits - before.commits) / count:.2f} commits")
    if after.rollbacks != before.rollbacks:
        parts.append(f"{(after.rollbacks - before.rollbacks) / count:.3f} rollbacks")
    if before.wal_syncs is not None and after.wal_syncs is not None:
        parts.append(f"{(after.wal_syncs - before.wal_syncs) / count:.2f} WAL syncs")
    if before.wal_bytes is not None and after.wal_bytes is not None:
        parts.append(f"{(after.wal_bytes - before.wal_bytes) / count / 1024:.1f} KiB WAL")
    return "per run: " + ", ".join(parts)


def enable_statements(url: str) -> None:
    """Create the ``pg_stat_statements`` view in the benchmark database; a server that does not load
    the module fails here with what to change."""
    import psycopg

    with psycopg.connect(url, connect_timeout=10, autocommit=True) as connection:
        try:
            connection.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            connection.execute("SELECT count(*) FROM pg_stat_statements")
        except psycopg.Error as error:
            raise SystemExit(
                "--statements needs pg_stat_statements: add it to shared_preload_libraries (and set "
                f"pg_stat_statements.track = all) on the server, or use the throwaway server. ({error})"
            ) from None


def _statements(connection: Any) -> Statements:
    rows = connection.execute(
        "SELECT queryid, toplevel, query, calls, total_exec_time FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchall()
    return {(queryid, toplevel): (query, calls, total) for queryid, toplevel, query, calls, total in rows}


def _label(query: str, width: int = 96) -> str:
    """A statement's text on one line, without schema names, cut to ``width``."""
    text = " ".join(query.split())
    text = re.sub(r'"[^"]+"\.', "", text)
    return text if len(text) <= width else text[: width - 3] + "..."


def statement_costs(count: int, before: Counters, after: Counters, shown: int = 10) -> list[str]:
    """The statements that took the most server execution time since ``before``, per run. A top-level
    statement's time includes the statements it ran (the commit functions'), which are indented."""
    if before.statements is None or after.statements is None:
        return []
    spent = []
    for key, (query, calls, total) in after.statements.items():
        _, calls_before, total_before = before.statements.get(key, (query, 0, 0.0))
        if calls > calls_before and "pg_stat" not in query and "runlane_bench_floor" not in query:
            spent.append((total - total_before, calls - calls_before, key[1], query))
    spent.sort(key=lambda item: item[0], reverse=True)
    lines = ["server execution time per run, by statement (pg_stat_statements; indented: run by a statement above):"]
    for total, calls, toplevel, query in spent[:shown]:
        indent = "" if toplevel else "  "
        lines.append(f"  {total * 1000 / count:7.1f} us {calls / count:6.2f} calls  {indent}{_label(query)}")
    return lines


def commit_floor(url: str, commits: int = 100) -> str:
    """Latency of the smallest durable commit (a one-row insert), back to back: every trigger and
    every claim waits for at least one such WAL flush, so this bounds the figures below. On a shared
    or virtual disk it varies a lot over time; it is measured before each measurement."""
    import psycopg

    table = f"runlane_bench_floor_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, connect_timeout=10, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE {table} (n integer)")
        try:
            timings = []
            for n in range(commits):
                started = time.perf_counter()
                connection.execute(f"INSERT INTO {table} VALUES (%s)", (n,))
                timings.append((time.perf_counter() - started) * 1000)
        finally:
            connection.execute(f"DROP TABLE {table}")
    timings.sort()
    return f"durable one-row commit p50 {statistics.median(timings):.2f} ms, p90 {_percentile(timings, 0.9):.2f} ms"


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


# ---------------------------------------------------------------------------------------------
# Worker processes


async def _worker_process(url: str, mode: str, concurrency: int) -> None:
    runtime = create_runlane(lane=lane(url), queues=[bench_queue], tasks=[noop], worker_id=f"bench-{os.getpid()}")
    async with runtime:
        # Warm the pool before the barrier so connection setup is not measured.
        await runtime.runs.list(limit=1)
        if _latency_log:
            _record_hints(runtime)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(None, sys.stdin.readline) == "":  # the barrier
            return
        cpu = time.process_time()
        if mode == "drain":
            worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=concurrency)
            await worker.closed
        else:
            worker = runtime.worker(
                mode=WorkerMode.POLL,
                concurrency=concurrency,
                on_run_executed=_record_finished(_latency_log[0]) if _latency_log else None,
            )
            await loop.run_in_executor(None, sys.stdin.readline)  # stop
            await worker.stop()
        finished = time.time()
        result = {"executed": worker.executed, "finished": finished, "cpu": time.process_time() - cpu}
        print(json.dumps(result), flush=True)


def _record_hints(runtime: Any) -> None:
    """Log when each wake hint reaches this process (the latency breakdown's middle part)."""
    driver = runtime.lane.storage
    subscribe = getattr(driver, "subscribe_wake_hints", None)
    if subscribe is None:
        return

    def on_hint(_queue: str) -> None:
        _unwritten.append(f"hint {time.time():.6f}\n")

    subscribe(on_hint)


def _record_finished(path: str) -> Callable[[Any], None]:
    """Write the log lines kept so far as each latency sample's run finishes, then tell the producer
    (it waits for that line on this process's stdout before it triggers the next run)."""

    def on_run_executed(run: Any) -> None:
        with open(path, "a") as log:
            log.write("".join(_unwritten))
        _unwritten.clear()
        print(f"done {run.payload['i']}", flush=True)

    return on_run_executed


class Worker:
    """One worker process: ``ready`` after connecting, starts at the barrier, prints a JSON result."""

    def __init__(self, url: str, mode: str, concurrency: int, log: str = "") -> None:
        command = [sys.executable, __file__, "--role", "worker", "--url", url, "--mode", mode]
        command += ["--concurrency", str(concurrency)]
        if log:
            command += ["--latency-log", log]
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )

    def failure(self, what: str) -> RuntimeError:
        self.stderr.seek(0)
        tail = self.stderr.read().decode("utf-8", "replace").strip().splitlines()[-15:]
        return RuntimeError(f"a worker process {what}" + ("\n  " + "\n  ".join(tail) if tail else ""))

    def read_line(self, timeout: float) -> str:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise self.failure(f"printed nothing for {timeout:.0f} s")
        return self.process.stdout.readline()

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        line = self.read_line(timeout)
        try:
            return json.loads(line)
        except ValueError:
            raise self.failure(f"exited without a result ({line.strip()!r})") from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        self.stderr.close()


def _await_ready(workers: list[Worker]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    for worker in workers:
        line = worker.read_line(max(1.0, deadline - time.monotonic()))
        if line.strip() != "ready":
            raise worker.failure(f"failed to start ({line.strip()!r})")


# ---------------------------------------------------------------------------------------------
# Measurements


async def _trigger(
    url: str, runs: int, producers: int, payload: Callable[[int], dict] | None = None
) -> tuple[float, float]:
    """Trigger ``runs`` runs from ``producers`` tasks: (triggers per second, Python CPU seconds)."""
    runtime = create_runlane(lane=lane(url), queues=[bench_queue], tasks=[noop])
    async with runtime:
        await runtime.runs.list(limit=1)
        share = [runs // producers + (1 if index < runs % producers else 0) for index in range(producers)]

        async def produce(count: int) -> None:
            for n in range(count):
                await runtime.trigger(noop, payload(n) if payload else {"n": n})

        cpu = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(produce(count) for count in share))
        return runs / (time.perf_counter() - started), time.process_time() - cpu


def burn_down(url: str, meter: Meter, runs: int, processes: int, concurrency: int) -> None:
    print(f"  burn-down ({_load()}; {commit_floor(meter.url)}):")
    before = meter.sample()
    trigger_rate, cpu = asyncio.run(_trigger(url, runs, 8))
    after = meter.settle()
    print(f"    pre-trigger, 8 producers: {trigger_rate:,.0f} triggers/s; {_cost(runs, before, after, cpu)}")
    _print_statements(runs, before, after)
    workers = [Worker(url, "drain", concurrency) for _ in range(processes)]
    try:
        _await_ready(workers)
        before = meter.sample()
        started = time.time()
        for worker in workers:
            worker.send("go")
        results = [worker.result(WORKER_TIMEOUT) for worker in workers]
    finally:
        for worker in workers:
            worker.close()
    after = meter.settle()
    executed = sum(result["executed"] for result in results)
    if executed != runs:
        raise RuntimeError(f"the workers drained {executed} of {runs} runs")
    rate = runs / (max(result["finished"] for result in results) - started)
    python_cpu = sum(result["cpu"] for result in results)
    print(
        f"    {runs:,} pre-triggered no-op runs, {processes} worker processes x {concurrency} slots: "
        f"{rate:,.0f} runs/s"
    )
    print(f"    {_cost(runs, before, after, python_cpu)}")
    _print_statements(runs, before, after)


def trigger_throughput(url: str, meter: Meter, runs: int, producers: int) -> None:
    floor = commit_floor(meter.url)
    before = meter.sample()
    rate, cpu = asyncio.run(_trigger(url, runs, producers))
    after = meter.settle()
    print(
        f"  trigger, {producers} producer(s), {runs:,} runs ({_load()}; {floor}): {rate:,.0f} triggers/s; "
        f"{_cost(runs, before, after, cpu)}"
    )
    _print_statements(runs, before, after)


def _print_statements(count: int, before: Counters, after: Counters) -> None:
    for line in statement_costs(count, before, after):
        print("    " + line)


def _percentile(values: list[float], fraction: float) -> float:
    return values[min(len(values) - 1, max(0, int(round(len(values) * fraction)) - 1))]


def _idle_round_trip(url: str, pause: float, samples: int = 50) -> float:
    """p50 ms of ``SELECT 1`` on a connection left idle for ``pause`` seconds before each call."""
    import psycopg

    async def measure() -> float:
        times = []
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute("SELECT 1")
            for _ in range(samples):
                await asyncio.sleep(pause)
                started = time.perf_counter()
                await conn.execute("SELECT 1")
                times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)

    return asyncio.run(measure())


def _finished(worker: Worker, index: int, timeout: float = 30.0) -> None:
    """Wait (blocked, not polling) until the worker reports run ``index`` finished: it is idle again."""
    line = worker.read_line(timeout).strip()
    if line != f"done {index}":
        raise worker.failure(f"reported {line!r} instead of finishing latency sample {index}")


def latency_parts(
    returned: list[tuple[float, float]], handlers: list[float], hints: list[float]
) -> tuple[list[float], list[float], list[float]]:
    """Where each sample's time went (ms): ``trigger()`` itself (its commit), from its return to the
    wake hint, and from the hint to the handler's first line (the worker's scan and claim).

    ``returned`` holds each sample's (trigger() called, trigger() returned) and ``handlers`` its
    handler's start, all ``time.time()``; ``hints`` (sorted) is when each hint reached the worker.
    A sample's hint is the first one after its ``trigger()`` was called: it may arrive just before
    ``trigger()`` returns, and any earlier one belongs to an earlier sample. A sample with no hint
    before its handler started (a debounced or lost hint: the worker polled) has only a commit part.
    """
    commits, delivery, claims = [], [], []
    for (sent, done), handler in zip(returned, handlers, strict=True):
        position = bisect.bisect_left(hints, sent)
        commits.append((done - sent) * 1000)
        if position < len(hints) and hints[position] <= handler:
            delivery.append((hints[position] - done) * 1000)
            claims.append((handler - hints[position]) * 1000)
    return commits, delivery, claims


def latency(url: str, meter: Meter, samples: int, pauses: list[float], log: Path) -> None:
    print(f"  trigger-to-start with an idle poll worker ({_load()}; {commit_floor(meter.url)}):")
    log.touch()
    worker = Worker(url, "poll", 1, str(log))
    returned: list[tuple[float, float]] = []  # (sent, trigger() returned) per sample
    before = after = None
    try:
        _await_ready([worker])
        worker.send("go")
        time.sleep(0.5)  # the worker is polling and listening, idle
        before = meter.sample()

        async def produce() -> None:
            runtime = create_runlane(lane=lane(url), queues=[bench_queue], tasks=[noop])
            async with runtime:
                await runtime.runs.list(limit=1)
                for index in range(samples * len(pauses)):
                    sent = time.time()
                    await runtime.trigger(noop, {"sent": sent, "i": index})
                    returned.append((sent, time.time()))
                    await asyncio.get_running_loop().run_in_executor(None, _finished, worker, index)
                    pause = pauses[index // samples]
                    if pause:
                        await asyncio.sleep(pause)

        asyncio.run(produce())
        after = meter.sample()
        worker.send("stop")
        worker.result(30)
    finally:
        worker.close()
    starts: dict[int, tuple[float, float]] = {}
    hints: list[float] = []
    for line in log.read_text().splitlines():
        kind, *fields = line.split()
        if kind == "start":
            starts[int(fields[0])] = (float(fields[1]), float(fields[2]))
        elif kind == "hint":
            hints.append(float(fields[0]))
    hints.sort()
    for number, pause in enumerate(pauses):
        indexes = range(number * samples, (number + 1) * samples)
        label = "back to back" if not pause else f"after {pause * 1000:g} ms idle"
        totals = sorted(starts[index][0] * 1000 for index in indexes)
        print(
            f"    {label}, {samples} samples: trigger() to the handler's first line p50 "
            f"{statistics.median(totals):.2f} ms, p99 {_percentile(totals, 0.99):.2f} ms, max {totals[-1]:.2f} ms"
        )
        handlers = [starts[index][1] for index in indexes]
        commits, delivery, claims = latency_parts([returned[index] for index in indexes], handlers, hints)
        for part, values in (
            ("trigger() (one round trip: its commit)", commits),
            ("wake hint received, after trigger() returned (negative: before it)", delivery),
            ("hint received to handler start (scan + claim)", claims),
        ):
            if values:
                values.sort()
                print(
                    f"      {part}: p50 {statistics.median(values):.2f} ms, "
                    f"p99 {_percentile(values, 0.99):.2f} ms ({len(values)} samples)"
                )
        floor = _idle_round_trip(meter.url, pause)
        print(f"      floor here: SELECT 1 on a connection idle as long, p50 {floor:.2f} ms")
    if before is not None and after is not None:
        # Per sample: the producer's trigger and the worker's scans, claim and completion.
        _print_statements(samples * len(pauses), before, after)


# ---------------------------------------------------------------------------------------------


_SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_sync_method",
    "wal_level",
    "commit_delay",
    "shared_buffers",
    "max_connections",
)


async def _settings(url: str) -> dict[str, str]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, connect_timeout=10) as connection:
        values = {}
        for name in _SETTINGS:
            row = await (await connection.execute(f"SHOW {name}")).fetchone()
            values[name] = row[0]
        return values


async def _fresh_schema(url: str) -> str:
    from runlane_postgres import apply_postgres_migrations

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    await apply_postgres_migrations(url, schema=schema)
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}schema={schema}"


def _postmaster(url: str) -> int | None:
    """The server's postmaster pid when its data directory is readable here (a local server)."""
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=10) as connection:
            (directory,) = connection.execute("SHOW data_directory").fetchone()
        pid = int(Path(directory, "postmaster.pid").read_text().split()[0])
    except Exception:  # noqa: BLE001 - no superuser, or a remote server: no server CPU figures
        return None
    return pid if _process_cpu(pid) is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--concurrency", default="16", help="slots per worker process, comma-separated for one burn-down each"
    )
    parser.add_argument("--producers", default="1,4,8")
    parser.add_argument("--triggers", type=int, default=2000)
    parser.add_argument("--latency-samples", type=int, default=300, help="latency samples per pause")
    parser.add_argument("--pauses", default="0,0.02", help="seconds between latency samples, comma-separated")
    parser.add_argument("--only", default="burn,trigger,latency", help="comma-separated measurements to run")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VALUE", help="extra throwaway-server setting"
    )
    parser.add_argument(
        "--statements",
        action="store_true",
        help="print server execution time per run by statement (pg_stat_statements)",
    )
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="drain", help=argparse.SUPPRESS)
    parser.add_argument("--latency-log", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        if args.latency_log:
            _latency_log.append(args.latency_log)
        asyncio.run(_worker_process(args.url, args.mode, int(args.concurrency)))
        return
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - {"burn", "trigger", "latency"}
    if unknown:
        parser.error(f"unknown measurement(s) in --only: {', '.join(sorted(unknown))}")

    server = None
    url = os.environ.get("RUNLANE_POSTGRES_BENCH_URL")
    if url is None:
        from runlane_postgres.testing import PostgresTestServer

        settings = dict(setting.split("=", 1) for setting in args.setting)
        if args.statements:
            settings = {**STATEMENT_SETTINGS, **settings}
        server = PostgresTestServer(settings=settings)
        server.start()
        url = server.url
    elif args.setting:
        parser.error("--setting applies only to the throwaway server (RUNLANE_POSTGRES_BENCH_URL is set)")
    try:
        settings = asyncio.run(_settings(url))
        if args.statements:
            enable_statements(url)
        meter = Meter(url, _postmaster(url), statements=args.statements)
        print(f"postgres_bench: Python {platform.python_version()}, {os.cpu_count()} CPUs, {_load()}")
        print("  PostgreSQL: " + ", ".join(f"{name}={value}" for name, value in settings.items()))
        if meter.postmaster is None:
            print("  (the server's processes are not readable here: no PostgreSQL CPU figures)")
        if "burn" in only:
            for concurrency in (int(value) for value in args.concurrency.split(",")):
                burn_down(asyncio.run(_fresh_schema(url)), meter, args.runs, args.processes, concurrency)
        if "trigger" in only:
            for producers in (int(value) for value in args.producers.split(",")):
                trigger_throughput(asyncio.run(_fresh_schema(url)), meter, args.triggers, producers)
        if "latency" in only:
            log = Path(tempfile.gettempdir(), f"runlane-bench-latency-{uuid.uuid4().hex[:8]}.log")
            try:
                pauses = [float(value) for value in args.pauses.split(",") if value.strip()]
                latency(asyncio.run(_fresh_schema(url)), meter, args.latency_samples, pauses, log)
            finally:
                log.unlink(missing_ok=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
