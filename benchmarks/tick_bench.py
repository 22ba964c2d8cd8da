"""Maintenance throughput: how long tick() takes with N due runs, and runs/second moved to queued.

Sets up N runs that failed once and wait in ``retrying`` for their backoff, moves the clock past it,
then measures (1) one tick() at the default phase limits and (2) ticks with a large delivery-request
limit until every due run has been moved back to ``queued``.

    .venv/bin/python benchmarks/tick_bench.py [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import time

from runlane import Retry, RunStatus, WorkerMode, contract_defaults, create_runlane, queue, task
from runlane.testing import ControlledClock
from runlane_local import local_lane

maintenance_queue = queue("maintenance", default=True)


@task("bench.fails_once", queue=maintenance_queue, retry=Retry(max_attempts=2, backoff="1m"))
async def fails_once(payload: dict) -> None:
    raise ConnectionError("transient")


async def run(runs: int) -> None:
    # Every run's first attempt fails on purpose; its warning (with a traceback) would be N records on stderr.
    logging.getLogger("runlane.task").setLevel(logging.CRITICAL)
    clock = ControlledClock()
    runlane = create_runlane(lane=local_lane(), queues=[maintenance_queue], tasks=[fails_once], clock=clock)
    async with runlane:
        for i in range(runs):
            await runlane.trigger(fails_once, {"n": i})
        await runlane.worker(mode=WorkerMode.DRAIN, concurrency=8).closed
        retrying = await runlane.runs.list(statuses=[RunStatus.RETRYING], limit=1)
        assert retrying.data, "setup should leave runs retrying"
        clock.advance("2m")

        started = time.perf_counter()
        first = await runlane.tick()
        one_tick = time.perf_counter() - started

        moved = first.delivery_requested
        started = time.perf_counter()
        ticks = 0
        while True:
            result = await runlane.tick(delivery_request_limit=1000)
            ticks += 1
            moved += result.delivery_requested
            if result.delivery_requested == 0:
                break
        elapsed = time.perf_counter() - started
    default_limit = contract_defaults.maintenance.delivery_request_limit
    print(f"tick() on the in-memory lane ({platform.python_implementation()} {platform.python_version()}), {runs:,} due runs")
    print(f"  one tick at default limits:   {one_tick * 1000:8.1f} ms  (moved {first.delivery_requested} runs, limit {default_limit})")
    print(f"  draining the rest:            {(runs - first.delivery_requested) / elapsed:8,.0f} runs/s moved due -> queued"
          f"  ({ticks} ticks at limit 1000, {moved:,} runs moved in all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    asyncio.run(run(parser.parse_args().runs))


if __name__ == "__main__":
    main()
