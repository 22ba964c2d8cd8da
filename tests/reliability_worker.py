"""A worker process for the multi-process reliability tests (run as a script, not collected).

    python reliability_worker.py LANE --mode drain|poll [--concurrency N] [--log FILE]
        [--sleep SECONDS] [--lease DURATION] [--heartbeat DURATION]

LANE is ``sqlite:<path>`` or ``postgres:<url>``. Every attempt appends ``run_id attempt pid`` to
``--log``, and every call of a ``reliable.steps`` step function ``step run_id key attempt pid`` (one
short ``O_APPEND`` write each, so concurrent processes never interleave a line). The process prints
``ready`` once its worker runs, stops cooperatively on SIGTERM, and prints one JSON line with its
counts when it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time

from runlane import Retry, TaskContext, WorkerMode, create_runlane, queue, task
from runlane.core.lanes import Lane

DEFAULT = queue("default", default=True)
BOUNDED = queue("bounded", concurrency_limit=2)
_settings: dict[str, object] = {}


def _log(line: str) -> None:
    descriptor = os.open(str(_settings["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


@task("reliable.work")
async def work(payload: dict, ctx: TaskContext) -> int:
    _log(f"{ctx.run_id} {ctx.attempt} {os.getpid()}\n")
    delay = float(_settings["sleep"])  # type: ignore[arg-type]
    if delay:
        await asyncio.sleep(delay)
    return int(payload["n"])


@task("reliable.bounded", queue=BOUNDED, concurrency_key=lambda payload: payload["key"], retry=Retry(3, "100ms"))
async def bounded(payload: dict, ctx: TaskContext) -> int:
    """Holds its partition for a while; logs ``start``/``end`` with a system-wide monotonic time, so
    the test can count how many attempts of one partition overlapped. Fails its first attempt when
    the payload says so, to go through a retry's capacity reservation."""
    key = payload["key"]
    _log(f"start {ctx.run_id} {ctx.attempt} {os.getpid()} {key} {time.monotonic():.6f}\n")
    await asyncio.sleep(float(_settings["sleep"]))  # type: ignore[arg-type]
    _log(f"end {ctx.run_id} {ctx.attempt} {os.getpid()} {key} {time.monotonic():.6f}\n")
    if payload.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return int(payload["n"])


@task("reliable.steps")
async def stepped(payload: dict, ctx: TaskContext) -> list[str]:
    """Three durable steps, each held ``--sleep`` seconds; every call of a step's ``fn`` appends
    ``step run_id key attempt pid`` to the log, so the test can tell which attempt ran which step."""
    _log(f"{ctx.run_id} {ctx.attempt} {os.getpid()}\n")
    outputs = []
    for key in ("first", "second", "third"):

        async def call(token: str, key: str = key) -> str:
            _log(f"step {ctx.run_id} {key} {ctx.attempt} {os.getpid()}\n")
            await asyncio.sleep(float(_settings["sleep"]))  # type: ignore[arg-type]
            return f"{key} by attempt {ctx.attempt}"

        outputs.append(await ctx.step.run(key, call))
    return outputs


def make_lane(spec: str) -> Lane:
    kind, _, target = spec.partition(":")
    if kind == "sqlite":
        from runlane_local import sqlite_lane

        return sqlite_lane(target)
    if kind == "postgres":
        from runlane_postgres import postgres_polling_lane

        return postgres_polling_lane(target)
    raise SystemExit(f"unknown lane {spec!r}")


async def main(arguments: argparse.Namespace) -> dict[str, int]:
    runtime = create_runlane(
        lane=make_lane(arguments.lane),
        queues=[DEFAULT, BOUNDED],
        tasks=[work, bounded, stepped],
        worker_id=f"worker-{os.getpid()}",
    )
    async with runtime:
        options: dict[str, object] = {"mode": WorkerMode(arguments.mode), "concurrency": arguments.concurrency}
        if arguments.lease:
            options["lease_duration"] = arguments.lease
        if arguments.heartbeat:
            options["heartbeat_interval"] = arguments.heartbeat
        if arguments.mode == "poll":
            options["empty_poll_delay"] = "20ms"
        worker = runtime.worker(**options)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, worker.request_stop)
        print("ready", flush=True)
        await worker.closed
        return {"executed": worker.executed, "storage_errors": worker.storage_errors}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("lane")
    parser.add_argument("--mode", default="drain", choices=["drain", "poll"])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--log", required=True)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--lease", default=None)
    parser.add_argument("--heartbeat", default=None)
    args = parser.parse_args()
    _settings.update(log=args.log, sleep=args.sleep)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
    counts = asyncio.run(main(args))
    print(json.dumps(counts), flush=True)
