"""The ``local`` lane: a fresh in-memory storage driver with storage polling.

Process-local and not production durable: state lives in this process only and is lost when it exits.
"""

from __future__ import annotations

from runlane.core.lanes import Lane, LaneDelivery, create_lane
from runlane.vocabulary import LaneDeliveryMode

from .memory import Clock, local_storage_driver

__all__ = ["local_lane"]


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
