"""``LaneCompositionConformance``: the lane composition contract as a pytest base class a lane package
subclasses.

A lane composes a storage driver with an explicit delivery mode; it adds no runtime behaviour of its
own. The suite proves that composition through the lane's public surface:

- its shape: a ``Lane`` with a non-empty name, a storage driver, a ``LaneDelivery`` whose mode matches
  its transport (none for storage polling, a ``TransportAdapter`` for transport delivery);
- honest capabilities: ``capabilities.storage`` is the storage driver's own profile, ``process_local``
  is the profile's, operator reads only over a driver that has them, production durability only over
  durable storage shared across processes;
- its lifecycle: ``start()`` then ``close()`` succeed;
- the composed flow over ``create_runlane``: a triggered run's wakeup is published through the lane's
  transport by the maintenance pass, exactly once (transport delivery), or no outbox row exists at all
  (storage polling), and the run then executes.

Usage::

    class TestMyLane(LaneCompositionConformance):
        queue_name = "conformance.default"  # a queue the lane's transport is bound to, if it has one

        @pytest.fixture
        def lane(self):
            return my_lane(...)  # fresh and not yet started, one per test

External resources (a schema, a queue) belong in the fixture: create them before returning the lane
and remove them after a ``yield``. Runs use an environment of their own per test, so lanes over one
shared database do not see each other's runs. Test methods are plain synchronous functions that run
their body with ``asyncio.run`` under a hard timeout, so no async pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from ..core.authoring import QueueDefinition, queue, task
from ..core.lanes import Lane, LaneCapabilities, LaneDelivery, TransportAdapter
from ..core.runtime import create_runlane
from ..storage import StorageDurability, StorageProfile, supports_operator_reads
from ..vocabulary import LaneDeliveryMode, RunStatus, TriggerDispatchMode

__all__ = ["LaneCompositionConformance"]

_STORAGE_METHODS = ("get", "query", "with_transaction")


@task("conformance.lane.noop")
async def _noop(payload: dict[str, Any]) -> dict[str, Any]:
    return {"echo": payload.get("n")}


class LaneCompositionConformance:
    """Subclass as ``Test...`` and override the ``lane`` fixture (a fresh, unstarted ``Lane`` per test)."""

    #: The queue the suite's runs go to; a transport lane's transport must be bound to it (the suite's runtime
    #: registers every other queue the transport lists in ``queues`` too).
    queue_name: str = "conformance.default"
    #: Hard limit for one test's body; nothing in the suite may hang.
    timeout_seconds: float = 60.0

    @pytest.fixture
    def lane(self) -> Lane:
        pytest.fail("Override the `lane` fixture: return a fresh, unstarted Lane for every test.")

    # -- harness ---------------------------------------------------------------------------------

    def run_async(self, body: Callable[[], Awaitable[Any]]) -> None:
        try:
            asyncio.run(asyncio.wait_for(body(), self.timeout_seconds))
        except TimeoutError:
            raise AssertionError(f"the test did not finish within {self.timeout_seconds}s") from None

    def runtime(self, lane: Lane) -> Any:
        return create_runlane(
            lane=lane,
            queues=self._queues(lane),
            tasks=[_noop],
            environment=f"lane-conformance-{uuid.uuid4().hex[:12]}",
            dispatch=TriggerDispatchMode.DEFERRED,  # wakeups wait for tick(), which reports what it published
        )

    def _queues(self, lane: Lane) -> list[QueueDefinition]:
        """``queue_name``, and every other queue the lane's transport lists in ``queues``: a runtime must
        register exactly the queues its transport binds, so a transport bound to several passes as it is."""
        transport = lane.delivery.transport if isinstance(lane.delivery, LaneDelivery) else None
        bound = getattr(transport, "queues", None) or ()
        found: dict[str, QueueDefinition] = {}
        for binding in bound:
            if isinstance(binding, QueueDefinition):
                found[binding.name] = binding
            elif isinstance(binding, str) and binding:
                found.setdefault(binding, queue(binding))
        if bound and self.queue_name not in found:
            raise AssertionError(
                f"the lane's transport binds {', '.join(repr(name) for name in found) or 'no queue'}, not "
                f"queue_name {self.queue_name!r}; set queue_name to one of its queues"
            )
        found.setdefault(self.queue_name, queue(self.queue_name))
        return list(found.values())

    # =============================================================================================
    # Shape and capabilities

    def test_lane_shape(self, lane: Any) -> None:
        """A Lane with a non-empty name, a storage driver, and a delivery mode that matches its transport."""
        assert isinstance(lane, Lane), f"a lane package returns a Lane (create_lane(...)), got {lane!r}"
        assert isinstance(lane.name, str) and lane.name.strip(), f"a lane has a non-empty name, got {lane.name!r}"
        storage = lane.storage
        missing = [name for name in _STORAGE_METHODS if not callable(getattr(storage, name, None))]
        assert not missing, f"the lane's storage is not a storage driver (missing {', '.join(missing)})"
        assert isinstance(getattr(storage, "name", None), str) and storage.name, "the storage driver has a name"
        delivery = lane.delivery
        assert isinstance(delivery, LaneDelivery), f"the delivery is a LaneDelivery, got {delivery!r}"
        if delivery.mode is LaneDeliveryMode.TRANSPORT:
            assert isinstance(delivery.transport, TransportAdapter), (
                f"transport delivery carries a TransportAdapter, got {delivery.transport!r}"
            )
        else:
            assert delivery.mode is LaneDeliveryMode.STORAGE_POLLING, f"unknown delivery mode {delivery.mode!r}"
            assert delivery.transport is None, "a storage-polling lane has no transport"

    def test_capabilities_are_honest(self, lane: Any) -> None:
        """Capabilities expose the storage profile itself and claim nothing the storage cannot do."""
        capabilities = lane.capabilities
        assert isinstance(capabilities, LaneCapabilities), f"capabilities are LaneCapabilities, got {capabilities!r}"
        profile = lane.storage.profile
        assert isinstance(profile, StorageProfile), "the storage driver reports a StorageProfile"
        assert capabilities.storage is profile, "capabilities.storage is the storage driver's own profile"
        assert capabilities.process_local is profile.process_local, "process_local is the storage profile's"
        if capabilities.operator_reads:
            assert supports_operator_reads(lane.storage), "operator reads are claimed over a driver without them"
        if capabilities.production_durable:
            assert profile.durability is StorageDurability.DURABLE and not profile.process_local, (
                "production durability is claimed over storage that is not durable and shared across processes"
            )

    def test_start_then_close(self, lane: Any) -> None:
        """start() brings storage (then the transport) up; close() takes them down."""

        async def body() -> None:
            await lane.start()
            await lane.close()

        self.run_async(body)

    # =============================================================================================
    # The composed flow

    def test_a_triggered_run_is_woken_by_the_lane_delivery_mode_and_executes(self, lane: Any) -> None:
        """Transport delivery: tick() publishes the run's wakeup through the transport, once. Storage
        polling: there is nothing to publish. Either way the run then executes."""
        transport = lane.delivery.mode is LaneDeliveryMode.TRANSPORT

        async def body() -> None:
            runtime = self.runtime(lane)
            async with runtime:
                created = await runtime.trigger(_noop, {"n": 7}, queue=self.queue_name)
                assert created.run.status is RunStatus.QUEUED
                first = await runtime.tick()
                assert (first.outbox_failed, first.outbox_dead_lettered) == (0, 0), (
                    f"the lane's transport did not take the wakeup: {first}"
                )
                assert first.outbox_published == (1 if transport else 0), (
                    f"expected {1 if transport else 0} wakeup published by tick(), got {first.outbox_published}"
                )
                again = await runtime.tick()
                assert again.outbox_published == 0, "a published wakeup is published once"
                done = await runtime.execute_next()
                assert done is not None and done.id == created.run.id, "the triggered run executes"
                assert done.status is RunStatus.SUCCEEDED and done.output == {"echo": 7}

        self.run_async(body)
