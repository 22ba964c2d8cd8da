"""Mistakes a type checker must catch in code written against Runlane's public API.

Each line that ends in ``# expect: [code]`` must get exactly that mypy error, and no other line any
error; ``tests/test_typing.py`` checks both. Without the package's type information every one of
these would pass silently and fail only at run time.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from runlane import RunStatus, TaskContext, WorkerMode, create_runlane, queue, task
from runlane.cli.main import with_runtim  # expect: [attr-defined]
from runlane.plugins.registries import LaneProvider, ProviderContext
from runlane.testing import ControledClock  # expect: [attr-defined]
from runlane.testing import StorageDriverConformanse  # expect: [attr-defined]
from runlane_local import local_lane
from runlane_otlp import otlp_snk  # expect: [attr-defined]
from runlane_postgres import postgres_polling_lane, postgres_storag  # expect: [attr-defined]

jobs = queue("jobs", default=True)


@task("jobs.noop", queue=jobs)
async def noop(payload: int, ctx: TaskContext) -> None:
    ctx.release(30)  # expect: [arg-type]
    ctx.wait_for_signal("ready", timeout=1.5)  # expect: [arg-type]
    print(ctx.run_idd)  # expect: [attr-defined]


async def producer() -> None:
    runlane = create_runlane(lane=local_lane(), queues=jobs)  # expect: [arg-type]
    result = await runlane.trigger(noop, 1, idempotency_keyy="k")  # expect: [call-arg]
    print(result.run.statuss)  # expect: [attr-defined]
    await runlane.worker(mode=WorkerMode.DRAIN, concurrency="8").closed  # expect: [arg-type]
    run = await runlane.runs.get("run_1")
    print(run.status)  # expect: [union-attr]
    await runlane.runs.cancel()  # expect: [call-arg]
    queue("jobs", default="yes")  # expect: [arg-type]
    runlane.worker(mode="pol")  # expect: [arg-type]
    await runlane.runs.list(statuses=["queud"])  # expect: [list-item]
    await runlane.runs.events("run_1", types=["run.finished"])  # expect: [list-item]
    create_runlane(lane=local_lane(), queues=[jobs], dispatch="lazy")  # expect: [arg-type]
    print(RunStatus.DONE)  # expect: [attr-defined]


def sync_producer() -> None:
    runlane = create_runlane(lane=local_lane(), queues=[jobs])
    runlane.sync.trigger(noop, 1, singleton_kye="k")  # expect: [call-arg]
    runlane.sync.worker(mode=WorkerMode.DRAIN, max_runs="10")  # expect: [arg-type]
    runlane.sync.runs.list(limit="10")  # expect: [arg-type]
    print(runlane.sync.runs.get("run_1").status)  # expect: [union-attr]
    runlane.sync.observations.trim(older_than="7d", consumer="otlp")  # expect: [call-arg]
    runlane.sync.observations.trim(older_than="7d", limit="500")  # expect: [arg-type]


def clocked() -> None:
    create_runlane(lane=postgres_polling_lane("postgresql:///app"), queues=[jobs], clock="utc")  # expect: [arg-type]
    runtime = create_runlane(lane=local_lane(), queues=[jobs])
    runtime.clock.advance("1h")  # expect: [attr-defined]


def create_lane(options: object, context: ProviderContext) -> str:
    return "not a lane"


def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    register(LaneProvider("broken", BaseModel, create_lane))  # expect: [arg-type]
