"""Multi-process reliability on the durable lanes (SQLite file, real PostgreSQL server).

Worker processes are real ``python`` processes (``tests/reliability_worker.py``) sharing one
database with the test process, which triggers runs, calls ``tick()`` and reads the results
through the public runtime API. Every wait has a deadline and every process is killed in
``finally``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reliability_worker import BOUNDED, bounded, stepped, work
from runlane import RunStatus, create_runlane, queue
from runlane.core.lanes import Lane

WORKER = Path(__file__).with_name("reliability_worker.py")
DEFAULT = queue("default", default=True)
OUTCOMES = {"run.succeeded", "run.failed", "run.retry_scheduled", "run.released", "run.cancelled"}


@dataclass
class DurableLane:
    spec: str  # what a worker process gets: sqlite:<path> or postgres:<url>
    name: str

    def lane(self) -> Lane:
        kind, _, target = self.spec.partition(":")
        if kind == "sqlite":
            from runlane_local import sqlite_lane

            return sqlite_lane(target)
        from runlane_postgres import postgres_polling_lane

        return postgres_polling_lane(target)


@pytest.fixture(params=["sqlite", "postgres"])
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DurableLane]:
    if request.param == "sqlite":
        yield DurableLane(f"sqlite:{tmp_path / 'runlane.db'}", "sqlite")
        return
    from runlane_postgres import apply_postgres_migrations

    url = request.getfixturevalue("postgres_url")
    schema = f"rel_{uuid.uuid4().hex[:10]}"
    asyncio.run(apply_postgres_migrations(url, schema=schema))
    try:
        yield DurableLane(f"postgres:{url}?schema={schema}", "postgres")
    finally:
        asyncio.run(_drop_schema(url, schema))


async def _drop_schema(url: str, schema: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10) as connection:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class Workers:
    """Worker processes started from ``reliability_worker.py``; all are killed in ``close()``."""

    def __init__(self, durable: DurableLane, log: Path) -> None:
        self.durable = durable
        self.log = log
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, count: int, *options: str) -> None:
        for _ in range(count):
            process = subprocess.Popen(
                [sys.executable, str(WORKER), self.durable.spec, "--log", str(self.log), *options],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=WORKER.parent,
            )
            self.processes.append(process)

    def finish(self, timeout: float) -> list[dict[str, int]]:
        """Wait for every process (SIGTERM first for poll workers) and return their counts."""
        deadline = time.monotonic() + timeout
        results = []
        for process in self.processes:
            try:
                out, err = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate(timeout=10)
                raise AssertionError(f"a worker did not finish in {timeout}s:\n{err[-3000:]}") from None
            if process.returncode == -signal.SIGKILL:
                continue
            assert process.returncode == 0, f"worker failed ({process.returncode}):\n{err[-3000:]}"
            results.append({**json.loads(out.strip().splitlines()[-1]), "stderr": err})
        return results

    def terminate(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            try:
                process.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def attempts_logged(log: Path) -> list[tuple[str, int, int]]:
    if not log.exists():
        return []
    lines = [line for line in log.read_text().splitlines() if not line.startswith("step ")]
    return [(run_id, int(attempt), int(pid)) for run_id, attempt, pid in (line.split() for line in lines)]


async def trigger_runs(durable: DurableLane, count: int) -> list[str]:
    runtime = create_runlane(lane=durable.lane(), queues=[DEFAULT], tasks=[work])
    async with runtime:
        return [(await runtime.trigger(work, {"n": n})).run.id for n in range(count)]


async def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def histories(durable: DurableLane, run_ids: list[str]) -> dict[str, tuple[Any, list[str]]]:
    """Each run and its event types in sequence order, read through the public operator API."""
    runtime = create_runlane(lane=durable.lane(), queues=[DEFAULT], tasks=[work])
    found: dict[str, tuple[Any, list[str]]] = {}
    async with runtime:
        for run_id in run_ids:
            run = await runtime.runs.get(run_id)
            page = await runtime.runs.events(run_id, sort_by="sequence", limit=100)
            found[run_id] = (run, [record.event.type.value for record in page.data])
    return found


def test_four_worker_processes_drain_2000_runs_exactly_once(durable: DurableLane, tmp_path: Path) -> None:
    run_ids = asyncio.run(trigger_runs(durable, 2000))
    workers = Workers(durable, tmp_path / "attempts.log")
    try:
        workers.start(4, "--mode", "drain", "--concurrency", "4")
        results = workers.finish(timeout=240)
    finally:
        workers.close()
    assert sum(result["executed"] for result in results) == 2000
    assert all(result["executed"] > 0 for result in results), "every process took part"
    logged = attempts_logged(workers.log)
    assert Counter(run_id for run_id, _, _ in logged) == Counter(run_ids)  # each run executed exactly once
    assert {attempt for _, attempt, _ in logged} == {1}
    found = asyncio.run(histories(durable, run_ids))
    for run_id, (run, events) in found.items():
        assert run.status is RunStatus.SUCCEEDED and run.counters.attempts == 1, run_id
        assert events.count("run.succeeded") == 1 and events.count("run.lease_claimed") == 1


def test_kill_9_of_a_worker_mid_attempt_loses_no_run_and_records_no_outcome_twice(
    durable: DurableLane, tmp_path: Path
) -> None:
    run_ids = asyncio.run(trigger_runs(durable, 150))
    workers = Workers(durable, tmp_path / "attempts.log")

    async def scenario() -> int:
        workers.start(3, "--mode", "poll", "--concurrency", "4", "--sleep", "0.05", "--lease", "2s", "--heartbeat", "500ms")
        await wait_until(lambda: len(attempts_logged(workers.log)) >= 30, 120, "30 attempts")
        victim_pid = attempts_logged(workers.log)[-1][2]
        victim = next(process for process in workers.processes if process.pid == victim_pid)
        os.kill(victim_pid, signal.SIGKILL)  # in the middle of its attempts: no outcome, no heartbeat
        victim.wait(timeout=10)
        runtime = create_runlane(lane=durable.lane(), queues=[DEFAULT], tasks=[work])
        recovered = 0
        async with runtime:
            await asyncio.sleep(2.5)  # the victim's leases expire
            deadline = time.monotonic() + 180
            while True:
                recovered += (await runtime.tick()).delivery_requested
                page = await runtime.runs.list(statuses=[RunStatus.SUCCEEDED], limit=100)
                done = len(page.data)
                while page.next_cursor is not None:
                    page = await runtime.runs.list(statuses=[RunStatus.SUCCEEDED], limit=100, cursor=page.next_cursor)
                    done += len(page.data)
                if done == len(run_ids):
                    break
                assert time.monotonic() < deadline, f"only {done} of {len(run_ids)} runs finished"
                await asyncio.sleep(0.5)
        return victim_pid

    try:
        victim_pid = asyncio.run(asyncio.wait_for(scenario(), 300))
        workers.terminate()
        workers.finish(timeout=60)
    finally:
        workers.close()
    logged = attempts_logged(workers.log)
    assert len(set(logged)) == len(logged), "an attempt number was executed twice"
    interrupted = {run_id for run_id, _, pid in logged if pid == victim_pid} - {
        run_id for run_id, _, pid in logged if pid != victim_pid
    }
    found = asyncio.run(histories(durable, run_ids))
    for run_id, (run, events) in found.items():
        assert run.status is RunStatus.SUCCEEDED, run_id
        assert events.count("run.succeeded") == 1, (run_id, events)
        assert sum(events.count(kind) for kind in OUTCOMES) == 1, (run_id, events)
        assert run.counters.attempts == events.count("run.lease_claimed")
    # The victim's in-flight attempts were taken over by another process after their leases expired.
    victim_runs = {run_id for run_id, _, pid in logged if pid == victim_pid}
    reclaimed = [run_id for run_id, _, pid in logged if pid != victim_pid and run_id in victim_runs]
    assert reclaimed, "at least one of the killed worker's runs was re-executed elsewhere"
    for run_id in reclaimed:
        assert found[run_id][0].counters.attempts >= 2
    assert not interrupted or all(found[run_id][0].status is RunStatus.SUCCEEDED for run_id in interrupted)


def test_a_worker_paused_past_its_lease_records_nothing_for_its_attempts_when_it_resumes(
    durable: DurableLane, tmp_path: Path
) -> None:
    """A worker process stopped (SIGSTOP, as a stalled host or a long GC pause would) in the middle of
    durable steps, for longer than its lease, while maintenance runs in the test process: its runs are
    taken over and finished elsewhere. Once continued, its stale attempts record no step and no
    outcome: every run has one outcome per attempt and one terminal event, and every step stored is
    that of an attempt whose call of the step ran (each attempt calls a step at most once)."""
    log = tmp_path / "attempts.log"
    workers = Workers(durable, log)

    async def scenario() -> tuple[list[str], int, dict[tuple[str, str], Any]]:
        runtime = create_runlane(lane=durable.lane(), queues=[DEFAULT], tasks=[stepped])
        async with runtime:
            run_ids = [(await runtime.trigger(stepped, {})).run.id for _ in range(30)]
            lease = ("--lease", "1s", "--heartbeat", "250ms")
            workers.start(3, "--mode", "poll", "--concurrency", "2", "--sleep", "0.2", *lease)
            await wait_until(lambda: len(attempts_logged(log)) >= 6, 120, "six attempts")
            victim_pid = attempts_logged(log)[-1][2]  # its attempt has just started: it is in a step
            os.kill(victim_pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 2.5  # well past the victim's leases
                while time.monotonic() < deadline:
                    await runtime.tick()
                    await asyncio.sleep(0.1)
            finally:
                os.kill(victim_pid, signal.SIGCONT)
            deadline = time.monotonic() + 180
            while True:
                await runtime.tick()
                page = await runtime.runs.list(statuses=[RunStatus.SUCCEEDED], limit=100)
                if len(page.data) == len(run_ids):
                    steps = {
                        (run_id, key): await runtime.runs.step(run_id, key)
                        for run_id in run_ids
                        for key in ("first", "second", "third")
                    }
                    return run_ids, victim_pid, steps
                assert time.monotonic() < deadline, f"only {len(page.data)} of {len(run_ids)} runs finished"
                await asyncio.sleep(0.1)

    try:
        run_ids, victim_pid, steps = asyncio.run(asyncio.wait_for(scenario(), 240))
        workers.terminate()
        results = workers.finish(timeout=60)
    finally:
        workers.close()
    # The continued worker tried to record the outcome of its stale attempts, and was refused.
    assert any("lost its lease; its outcome is not recorded" in result["stderr"] for result in results)
    calls = Counter(tuple(line.split()[1:4]) for line in log.read_text().splitlines() if line.startswith("step "))
    assert max(calls.values()) == 1, "an attempt called one step twice"
    found = asyncio.run(histories(durable, run_ids))
    taken_over = [
        run_id
        for run_id, attempt, pid in attempts_logged(log)
        if pid == victim_pid and found[run_id][0].counters.attempts > attempt
    ]
    assert taken_over, "the paused worker's runs were run again elsewhere"
    for run_id, (run, events) in found.items():
        assert run.status is RunStatus.SUCCEEDED and events.count("run.succeeded") == 1, (run_id, events)
        assert sum(events.count(kind) for kind in OUTCOMES) == 1, (run_id, events)  # no retries: one outcome
        assert run.counters.attempts == events.count("run.lease_claimed"), (run_id, events)
        for key in ("first", "second", "third"):
            step = steps[(run_id, key)]
            assert step is not None and calls[(run_id, key, str(step.attempt))] == 1, (run_id, key, step)
            assert run.output[["first", "second", "third"].index(key)] == step.output


def partition_overlap(log: Path) -> dict[str, int]:
    """Per concurrency key, the most ``bounded`` attempts that were inside their handler at once."""
    changes: dict[str, list[tuple[float, int]]] = {}
    for line in log.read_text().splitlines():
        kind, _run_id, _attempt, _pid, key, at = line.split()
        # At equal times an end sorts before a start: touching intervals do not overlap.
        changes.setdefault(key, []).append((float(at), 1 if kind == "start" else -1))
    most: dict[str, int] = {}
    for key, moves in changes.items():
        inside = 0
        for _, move in sorted(moves):
            inside += move
            most[key] = max(most.get(key, 0), inside)
    return most


def test_bounded_queue_capacity_holds_across_worker_processes_with_maintenance_running(
    durable: DurableLane, tmp_path: Path
) -> None:
    """Three poll worker processes (12 slots) share a queue bounded to 2 runs per concurrency key while
    the test process runs maintenance (bounded dispatch, due retries) the way ``runlane dev`` does.
    Every third run fails its first attempt, so its retry goes back through a capacity reservation."""
    keys = ["a", "b", "c"]
    log = tmp_path / "attempts.log"
    workers = Workers(durable, log)

    async def scenario() -> list[str]:
        runtime = create_runlane(lane=durable.lane(), queues=[DEFAULT, BOUNDED], tasks=[work, bounded])
        async with runtime:
            run_ids = [
                (await runtime.trigger(bounded, {"n": n, "key": keys[n % 3], "fail_first": n % 3 == 0})).run.id
                for n in range(90)
            ]
            # Each attempt stays in its handler 0.1 s, so runs of a key overlap even on a loaded machine and the
            # partitions are seen full (an attempt of 20 ms could end before the next of its key started).
            workers.start(3, "--mode", "poll", "--concurrency", "4", "--sleep", "0.1")
            deadline = time.monotonic() + 180
            while True:
                await runtime.tick()
                page = await runtime.runs.list(statuses=[RunStatus.SUCCEEDED], limit=100)
                if len(page.data) == len(run_ids):
                    return run_ids
                assert time.monotonic() < deadline, f"only {len(page.data)} of {len(run_ids)} runs finished"
                await asyncio.sleep(0.1)

    try:
        run_ids = asyncio.run(asyncio.wait_for(scenario(), 240))
        workers.terminate()
        results = workers.finish(timeout=60)
    finally:
        workers.close()
    assert sum(result["executed"] for result in results) == 90 + 30  # 30 runs took a second attempt
    assert partition_overlap(log) == {"a": 2, "b": 2, "c": 2}  # full, and never more than the limit
    starts = [tuple(line.split()[1:3]) for line in log.read_text().splitlines() if line.startswith("start")]
    assert len(starts) == len(set(starts)) == 120, "an attempt number ran twice"
    found = asyncio.run(histories(durable, run_ids))
    for n, run_id in enumerate(run_ids):
        run, events = found[run_id]
        assert run.status is RunStatus.SUCCEEDED and run.counters.attempts == (2 if n % 3 == 0 else 1), (run_id, events)
        assert events.count("run.succeeded") == 1 and events.count("run.retry_scheduled") == (n % 3 == 0)


def test_a_postgres_restart_during_a_worker_loop_is_survived(tmp_path: Path) -> None:
    from postgres_support import restartable_postgres_server

    server, schema = restartable_postgres_server("restart")
    lane = DurableLane(f"postgres:{server.url}?schema={schema}", "postgres")
    workers = Workers(lane, tmp_path / "attempts.log")
    try:
        first = asyncio.run(trigger_runs(lane, 20))
        workers.start(1, "--mode", "poll", "--concurrency", "2")
        asyncio.run(wait_until(lambda: len(attempts_logged(workers.log)) >= 20, 60, "the first runs"))
        server.stop_server(mode="fast")
        time.sleep(1.5)  # the worker keeps polling a database that is gone
        server.start_server()
        second = asyncio.run(trigger_runs(lane, 20))
        asyncio.run(wait_until(lambda: len(attempts_logged(workers.log)) >= 40, 90, "the runs after the restart"))
        workers.terminate()
        (result,) = workers.finish(timeout=60)
    finally:
        workers.close()
    assert result["storage_errors"] >= 1
    assert "storage failed (storage_unavailable" in result["stderr"]
    assert "reachable again" in result["stderr"]
    found = asyncio.run(histories(lane, first + second))
    assert all(run.status is RunStatus.SUCCEEDED for run, _ in found.values())
