"""Memory of a long-running process: resident set size while batches of runs go through a poll worker.

One process on the in-memory lane runs a poll worker with 8 slots. Each batch triggers N runs (half
`async def` handlers with a durable step, half `def` handlers), waits until the worker has executed
them, then applies retention the way a deployment does: `runs.prune --all` for the runs and
`observations.trim` for the observation stream. With retention applied, the process must not grow
from batch to batch: whatever it keeps per run (attempt registries, caches, hint tables, handler
threads) shows up here as a rising RSS.

    .venv/bin/python benchmarks/memory_bench.py [--batches B] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import resource
import time

from runlane import RunStatus, TaskContext, WorkerMode, create_runlane, queue, task
from runlane_local import local_lane

memory_queue = queue("memory", default=True)


@task("bench.with_step", queue=memory_queue)
async def with_step(payload: dict, ctx: TaskContext) -> dict:
    await ctx.step.run("token", lambda token: {"prefix": token[:8]})
    return {"n": payload["n"]}


@task("bench.sync", queue=memory_queue)
def sync_handler(payload: dict) -> None:
    return None


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, where /proc is missing


async def run(batches: int, runs: int) -> list[float]:
    runtime = create_runlane(lane=local_lane(), queues=[memory_queue], tasks=[with_step, sync_handler])
    sizes: list[float] = []
    async with runtime:
        worker = runtime.worker(mode=WorkerMode.POLL, concurrency=8)
        try:
            for _ in range(batches):
                for n in range(runs):
                    await runtime.trigger(with_step if n % 2 else sync_handler, {"n": n})
                deadline = time.monotonic() + 120
                while (await runtime.runs.list(statuses=[RunStatus.QUEUED, RunStatus.RUNNING], limit=1)).data:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the worker did not execute the batch within 120 s")
                    await asyncio.sleep(0.02)
                cursor = None
                while True:
                    page = await runtime.runs.prune(older_than="1ms", limit=1000, cursor=cursor)
                    if (cursor := page.next_cursor) is None:
                        break
                while (await runtime.observations.trim(older_than="1ms", limit=10_000)).more:
                    pass
                gc.collect()
                sizes.append(rss_mb())
        finally:
            await worker.stop()
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1000)
    args = parser.parse_args()
    started = time.perf_counter()
    sizes = asyncio.run(run(args.batches, args.runs))
    elapsed = time.perf_counter() - started
    print(f"memory of a long-running worker process ({platform.python_implementation()} {platform.python_version()})")
    print(f"  {args.batches} batches of {args.runs:,} runs through a poll worker (8 slots), retention after each")
    print("  RSS after each batch (MB): " + " ".join(f"{size:.0f}" for size in sizes))
    growth = (sizes[-1] - sizes[1]) / max(1, (len(sizes) - 2) * args.runs) * 1024 if len(sizes) > 2 else 0.0
    print(f"  growth after the first batch: {sizes[-1] - sizes[1]:+.1f} MB ({growth:+.2f} KB per run); {elapsed:.1f} s")


if __name__ == "__main__":
    main()
