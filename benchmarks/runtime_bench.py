"""End-to-end runtime throughput and latency on the in-memory lane.

1. Burn-down: trigger N no-op runs, then drain them with a drain worker of C slots; prints runs/second
   for the whole thing (trigger + drain) and for each half.
2. Latency: a poll worker with the default empty-poll delay is running; runs are triggered one at a time
   and the time from trigger() returning... to the handler starting is recorded; prints p50/p99.

    .venv/bin/python benchmarks/runtime_bench.py [--runs N] [--concurrency C] [--latency-samples S]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

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


async def latency(samples: int) -> tuple[float, float]:
    started_at: dict[int, float] = {}
    done = asyncio.Event()

    latency_queue = queue("latency", default=True)

    @task("bench.latency", queue=latency_queue)
    async def record(payload: dict) -> None:
        started_at[payload["n"]] = time.perf_counter()
        if len(started_at) == samples:
            done.set()

    runlane = create_runlane(lane=local_lane(), queues=[latency_queue], tasks=[record])
    delays = []
    async with runlane:
        worker = runlane.worker(mode=WorkerMode.POLL, concurrency=1)
        await asyncio.sleep(0.05)
        for n in range(samples):
            before = time.perf_counter()
            await runlane.trigger(record, {"n": n})
            while n not in started_at:
                await asyncio.sleep(0)
            delays.append(started_at[n] - before)
        await asyncio.wait_for(done.wait(), 10)
        await worker.stop()
    delays.sort()
    return statistics.median(delays) * 1000, delays[int(len(delays) * 0.99) - 1] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency-samples", type=int, default=500)
    args = parser.parse_args()
    total, trigger_rate, drain_rate = asyncio.run(burn_down(args.runs, args.concurrency))
    p50, p99 = asyncio.run(latency(args.latency_samples))
    print(f"runtime on the in-memory lane ({platform.python_implementation()} {platform.python_version()})")
    print(f"  end to end: {total:10,.0f} runs/s  ({args.runs:,} no-op runs, drain worker with {args.concurrency} slots)")
    print(f"    trigger:  {trigger_rate:10,.0f} runs/s")
    print(f"    drain:    {drain_rate:10,.0f} runs/s")
    print(f"  poll worker trigger-to-start latency: p50 {p50:.3f} ms, p99 {p99:.3f} ms  ({args.latency_samples} samples, default empty_poll_delay)")


if __name__ == "__main__":
    main()
