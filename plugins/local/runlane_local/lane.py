"""The ``local`` lane (a fresh in-memory storage driver) and the ``sqlite`` lane (one durable file),
both with storage polling.

The local lane is process-local and not production durable: state lives in this process only and is
lost when it exits. The SQLite lane keeps its state in a file that every process on the machine can
open.
"""

from __future__ import annotations

import os
from datetime import timedelta

from runlane.core.lanes import Lane, LaneDelivery, create_lane
from runlane.vocabulary import LaneDeliveryMode

from runlane.storage.clock import Clock

from .memory import local_storage_driver
from .sqlite import sqlite_storage

__all__ = ["local_lane", "sqlite_lane"]


def local_lane(name: str = "local", *, clock: Clock | None = None) -> Lane:
    """An in-memory lane with operator reads, for development and tests.

    ``clock`` (for tests) is the storage clock every transaction's ``now()`` samples; a runtime created
    with ``create_runlane(clock=...)`` hands its clock to client-clock storage itself.
    """
    return create_lane(
        storage=local_storage_driver(clock=clock),
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        name=name,
        operator_reads=True,
        production_durable=False,
    )


def sqlite_lane(
    path: str | os.PathLike[str],
    *,
    name: str = "sqlite",
    clock: Clock | None = None,
    synchronous: str = "full",
    busy_timeout: float | str | timedelta = 5.0,
) -> Lane:
    """A lane over the SQLite file at ``path`` with storage polling and operator reads.

    The file (and its schema) is created on start when absent; its directory must exist. Every
    process on this machine that opens the same file shares the runs, schedules and workers' claims,
    so ``runlane work`` in one process and ``runlane trigger`` in another cooperate.

    ``production_durable`` is what ``create_lane`` allows it to be: durable storage that other
    processes reach. With ``synchronous="full"`` (the default) or ``"extra"`` a commit survives a
    crash and power loss, so the lane reports ``production_durable=True`` within its scope of one
    machine and one local disk (no failover, no network file systems). ``synchronous="normal"``
    may roll back the last commits after an OS crash or power loss, so that lane reports
    ``production_durable=False``.

    ``clock`` (for tests) is the storage clock every transaction's ``now()`` samples; a runtime created
    with ``create_runlane(clock=...)`` hands its clock to client-clock storage itself.
    """
    storage = sqlite_storage(path, clock=clock, synchronous=synchronous, busy_timeout=busy_timeout)
    return create_lane(
        storage=storage,
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        name=name,
        operator_reads=True,
        production_durable=storage.synchronous != "normal",
    )
