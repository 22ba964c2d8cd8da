"""Shared helpers for the runtime tests (``tests/test_runtime_*.py``); not a test module itself."""

from __future__ import annotations

from typing import Any

from runlane import Runlane, create_lane, create_runlane, queue
from runlane.core.authoring import QueueDefinition, TaskDefinition
from runlane.testing import ControlledClock
from runlane.vocabulary import LaneDeliveryMode
from runlane_local import LocalStorageStore, local_lane, local_storage_driver
from runlane.core.lanes import LaneDelivery

DEFAULT_QUEUE = queue("default", default=True)


def make_runtime(
    *tasks: TaskDefinition,
    queues: list[QueueDefinition] | None = None,
    clock: ControlledClock | None = None,
    **options: Any,
) -> tuple[Runlane, ControlledClock]:
    """A runtime over a fresh local lane with a controlled clock."""
    clock = clock or ControlledClock()
    runtime = create_runlane(
        lane=local_lane(), queues=queues or [DEFAULT_QUEUE], tasks=list(tasks), clock=clock, **options
    )
    return runtime, clock


def shared_runtimes(
    *task_sets: list[TaskDefinition],
    queues: list[QueueDefinition] | None = None,
    clock: ControlledClock | None = None,
    **options: Any,
) -> tuple[list[Runlane], ControlledClock]:
    """Several runtimes ("processes") over one in-memory store, each with its own lane and registry."""
    clock = clock or ControlledClock()
    store = LocalStorageStore()
    runtimes = []
    for index, tasks in enumerate(task_sets):
        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
            name=f"process-{index}",
        )
        runtimes.append(
            create_runlane(
                lane=lane, queues=queues or [DEFAULT_QUEUE], tasks=tasks, clock=clock, worker_id=f"worker-{index}", **options
            )
        )
    return runtimes, clock


async def event_types(runtime: Runlane, run_id: str) -> list[str]:
    """The run's event types in sequence order."""
    page = await runtime.runs.events(run_id, sort_by="sequence", limit=100)
    return [record.event.type.value for record in page.data]


async def all_runs(runtime: Runlane) -> list[Any]:
    page = await runtime.runs.list(limit=100)
    return page.data
