"""End-to-end runtime throughput and latency on the in-memory lane.

1. Burn-down: trigger N no-op runs, then drain them with a drain worker of C slots; prints runs/second
   for the whole thing (trigger + drain) and for each half.
2. Latency: a poll worker with one slot and the default empty-poll delay is running. Runs are triggered
   one at a time, each once the worker has finished the previous run (it is idle again), either at once
   ("back to back") or after a pause; prints p50/p99 from just before trigger() to the handler's first
   line, and how much of it trigger() itself took. After a pause the whole process starts cold (on a
   virtual machine its CPU may have been given away meanwhile); the pause is part of what is measured.

    .venv/bin/python benchmarks/runtime_bench.py [--runs N] [--concurrency C] [--latency-samples S]
        [--pauses 0,0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from dataclasses import dataclass

from runlane import WorkerMode, create_runlane, queue, task
from runlane_local import local_lane

bench_queue = queue("bench", default=True)


@task("bench.noop", queue=bench_queue)
async def noop(payload: dict) -> None:
    return None


async def burn_down(runs: int, concurrency: int) -> tuple[float, float, float]:
    runlane = create_runlane(lane=local_lane(), queues=[bench_queue], tasks=[noop])
    async with runlane:
        started = time.perf_counter()
        for i in range(runs):
            await runlane.trigger(noop, {"n": i})
        triggered = time.perf_counter()
        executed = 0

        def count(_run) -> None:
            nonlocal executed
            executed += 1

        await runlane.worker(mode=WorkerMode.DRAIN, concurrency=concurrency, on_run_executed=count).closed
        finished = time.perf_counter()
    assert executed == runs, f"drained {executed} of {runs} runs"
    return runs / (finished - started), runs / (triggered - started), runs / (finished - triggered)


@dataclass
class Latency:
    p50: float  # ms, trigger() called to the handler's first line
    p99: float
    trigger_p50: float  # ms, trigger() itself


async def latency(samples: int, pause: float) -> Latency:
    started_at: dict[int, float] = {}
    finished = asyncio.Event()

    latency_queue = queue("latency", default=True)

    @task("bench.latency", queue=latency_queue)
    async def record(payload: dict) -> None:
        started_at[payload["n"]] = time.perf_counter()

    runlane = create_runlane(lane=local_lane(), queues=[latency_queue], tasks=[record])
    delays: list[float] = []
    triggers: list[float] = []
    async with runlane:
        worker = runlane.worker(mode=WorkerMode.POLL, concurrency=1, on_run_executed=lambda run: finished.set())
        await asyncio.sleep(0.05)
        for n in range(samples):
            finished.clear()
            before = time.perf_counter()
            await runlane.trigger(record, {"n": n})
            triggers.append(time.perf_counter() - before)
            await asyncio.wait_for(finished.wait(), 10)  # the run is done: the worker is idle again
            delays.append(started_at[n] - before)
            if pause:
                await asyncio.sleep(pause)
        await worker.stop()
    delays.sort()
    return Latency(
        statistics.median(delays) * 1000,
        delays[max(0, int(len(delays) * 0.99) - 1)] * 1000,
        statistics.median(triggers) * 1000,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency-samples", type=int, default=500, help="0 skips the latency measurement")
    parser.add_argument("--pauses", default="0,0.02", help="seconds to pause between latency samples, comma-separated")
    args = parser.parse_args()
    pauses = [float(value) for value in args.pauses.split(",") if value.strip()] if args.latency_samples > 0 else []
    total, trigger_rate, drain_rate = asyncio.run(burn_down(args.runs, args.concurrency))
    latencies = [(pause, asyncio.run(latency(args.latency_samples, pause))) for pause in pauses]
    print(f"runtime on the in-memory lane ({platform.python_implementation()} {platform.python_version()})")
    print(f"  end to end: {total:10,.0f} runs/s  ({args.runs:,} no-op runs, drain worker with {args.concurrency} slots)")
    print(f"    trigger:  {trigger_rate:10,.0f} runs/s")
    print(f"    drain:    {drain_rate:10,.0f} runs/s")
    if latencies:
        print(
            f"  trigger-to-start latency, idle poll worker (1 slot, default empty_poll_delay, {args.latency_samples} samples each):"
        )
    for pause, measured in latencies:
        label = "back to back" if not pause else f"after {pause * 1000:g} ms idle"
        print(
            f"    {label + ':':18} p50 {measured.p50:.3f} ms, p99 {measured.p99:.3f} ms"
            f"  (trigger() itself p50 {measured.trigger_p50:.3f} ms)"
        )


if __name__ == "__main__":
    main()
