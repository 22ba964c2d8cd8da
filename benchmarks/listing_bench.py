"""Operator listings on a lane that holds many runs: the first ``runs.list()`` page after a write.

Triggers N runs, then, several times, triggers one more run and reads the newest page (what the
dashboard does every refresh while a worker writes), and then the page after it; prints the median
time of each. On the in-memory lane a listing is sorted once per stored state, so the page after a
write is the costly one; on SQLite both are index reads.

    .venv/bin/python benchmarks/listing_bench.py [--runs 20000] [--rounds 5] [--lane memory|sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from runlane import create_runlane, queue, task
from runlane_local import local_lane, sqlite_lane

bench_queue = queue("bench", default=True)


@task("bench.listed", queue=bench_queue)
async def listed(payload: dict) -> None:
    return None


async def measure(lane_name: str, runs: int, rounds: int, directory: Path) -> tuple[float, float]:
    lane = local_lane() if lane_name == "memory" else sqlite_lane(directory / "listing.db")
    runtime = create_runlane(lane=lane, queues=[bench_queue], tasks=[listed])
    after_write: list[float] = []
    next_page: list[float] = []
    async with runtime:
        for n in range(runs):
            await runtime.trigger(listed, {"n": n})
        await runtime.runs.list(limit=100)  # the first read after loading decodes every run once
        for _ in range(rounds):
            await runtime.trigger(listed, {})
            started = time.perf_counter()
            page = await runtime.runs.list(limit=100)
            after_write.append(time.perf_counter() - started)
            started = time.perf_counter()
            await runtime.runs.list(limit=100, cursor=page.next_cursor)
            next_page.append(time.perf_counter() - started)
    return statistics.median(after_write) * 1000, statistics.median(next_page) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lane", choices=["memory", "sqlite"], default="memory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        first, second = asyncio.run(measure(args.lane, args.runs, args.rounds, Path(directory)))
    print(f"runs.list() on the {args.lane} lane with {args.runs:,} runs (median of {args.rounds}):")
    print(f"  newest page after a write: {first:.1f} ms")
    print(f"  the page after it:         {second:.1f} ms")


if __name__ == "__main__":
    main()
