"""Lane composition: shape validation, capability claims, lifecycle order, and the local lane."""

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest

from runlane import ErrorCode, LaneDeliveryMode, RunlaneError
from runlane.core.lanes import Lane, LaneCapabilities, LaneDelivery, TransportAdapter, create_lane
from runlane.storage import StorageClockAuthority, StorageDurability, StorageIndexConsistency, StorageProfile
from runlane.testing import ControlledClock, LaneCompositionConformance
from runlane.testing import RecordingTransport as RecordingWakeups
from runlane_local import local_lane, local_storage_driver, sqlite_lane

PROCESS_LOCAL = StorageProfile(
    durability=StorageDurability.PROCESS,
    clock_authority=StorageClockAuthority.CLIENT,
    index_consistency=StorageIndexConsistency.STRONG,
    process_local=True,
)
DURABLE_SHARED = StorageProfile(
    durability=StorageDurability.DURABLE,
    clock_authority=StorageClockAuthority.TRANSACTION_AUTHORITATIVE,
    index_consistency=StorageIndexConsistency.STRONG,
)


class RecordingStorage:
    """A storage driver shape that records lifecycle calls into a shared log."""

    def __init__(self, log: list[str], *, profile: StorageProfile = PROCESS_LOCAL, fail_close: bool = False) -> None:
        self.name = "recording-storage"
        self.profile = profile
        self.log = log
        self.fail_close = fail_close

    async def start(self) -> None:
        self.log.append("storage.start")

    async def close(self) -> None:
        self.log.append("storage.close")
        if self.fail_close:
            raise RuntimeError("storage close failed")

    async def get(self, keys):
        return [None for _ in keys]

    async def query(self, query):
        raise AssertionError("lane composition and lifecycle never read or write storage")

    async def with_transaction(self, callback):
        raise AssertionError("lane composition and lifecycle never read or write storage")


class OperatorReadStorage(RecordingStorage):
    async def get_run(self, environment, run_id):
        return None

    async def list_runs(self, filter, pagination):
        raise AssertionError("lane composition and lifecycle never read or write storage")

    async def list_run_events(self, filter, pagination):
        raise AssertionError("lane composition and lifecycle never read or write storage")


class RecordingTransport:
    def __init__(self, log: list[str], *, fail_start: bool = False, fail_close: bool = False) -> None:
        self.name = "recording-transport"
        self.log = log
        self.fail_start = fail_start
        self.fail_close = fail_close

    async def start(self) -> None:
        self.log.append("transport.start")
        if self.fail_start:
            raise RuntimeError("transport start failed")

    async def close(self) -> None:
        self.log.append("transport.close")
        if self.fail_close:
            raise RuntimeError("transport close failed")

    async def publish_wakeups(self, command):
        return None


class SyncHookTransport:
    """Hooks may be plain methods, and are optional."""

    name = "sync-transport"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def start(self) -> None:
        self.log.append("transport.start")

    async def publish_wakeups(self, command):
        return None


class NoHookStorage:
    name = "no-hooks"
    profile = PROCESS_LOCAL

    async def get(self, keys):
        return []

    async def query(self, query):
        raise AssertionError("lane composition and lifecycle never read or write storage")

    async def with_transaction(self, callback):
        raise AssertionError("lane composition and lifecycle never read or write storage")


POLLING = LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING)


def invalid():
    return pytest.raises(RunlaneError, check=lambda error: error.code is ErrorCode.CONFIGURATION_INVALID)


def transport_lane(log: list[str], **transport_options) -> Lane:
    transport = RecordingTransport(log, **transport_options)
    return create_lane(
        storage=OperatorReadStorage(log), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
    )


# ---------------------------------------------------------------------------------------------
# Lifecycle order


async def test_polling_lane_starts_and_closes_storage_only():
    log: list[str] = []
    lane = create_lane(storage=OperatorReadStorage(log), delivery=POLLING)
    await lane.start()
    await lane.close()
    assert log == ["storage.start", "storage.close"]


async def test_transport_lane_starts_storage_first_and_closes_it_last():
    log: list[str] = []
    lane = transport_lane(log)
    await lane.start()
    await lane.close()
    assert log == ["storage.start", "transport.start", "transport.close", "storage.close"]


async def test_failed_transport_start_closes_storage_and_raises():
    log: list[str] = []
    lane = transport_lane(log, fail_start=True)
    with pytest.raises(RuntimeError, match="transport start failed"):
        await lane.start()
    assert log == ["storage.start", "transport.start", "storage.close"]


async def test_failed_transport_start_reports_a_storage_close_failure_too():
    log: list[str] = []
    transport = RecordingTransport(log, fail_start=True)
    lane = create_lane(
        storage=OperatorReadStorage(log, fail_close=True),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
    )
    with pytest.raises(RuntimeError, match="transport start failed") as caught:
        await lane.start()
    assert any("storage close failed" in note for note in caught.value.__notes__)


async def test_storage_is_closed_even_when_the_transport_fails_to_close():
    log: list[str] = []
    lane = transport_lane(log, fail_close=True)
    await lane.start()
    with pytest.raises(RuntimeError, match="transport close failed"):
        await lane.close()
    assert log[-2:] == ["transport.close", "storage.close"]


async def test_lifecycle_hooks_are_optional_and_may_be_plain_methods():
    log: list[str] = []
    lane = create_lane(
        storage=NoHookStorage(),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=SyncHookTransport(log)),
        operator_reads=False,
    )
    await lane.start()
    await lane.close()
    assert log == ["transport.start"]


# ---------------------------------------------------------------------------------------------
# Composition and capabilities


def test_lane_keeps_the_original_adapters_and_reports_capabilities():
    log: list[str] = []
    storage = OperatorReadStorage(log)
    transport = RecordingTransport(log)
    lane = create_lane(
        storage=storage, delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport), name="custom"
    )
    assert lane.name == "custom"
    assert lane.storage is storage
    assert lane.delivery.transport is transport and lane.delivery.mode is LaneDeliveryMode.TRANSPORT
    assert lane.capabilities == LaneCapabilities(
        operator_reads=True, production_durable=False, process_local=True, storage=PROCESS_LOCAL
    )
    assert lane.capabilities.storage is storage.profile
    assert isinstance(transport, TransportAdapter)
    assert "custom" in repr(lane)


def test_create_lane_defaults():
    lane = create_lane(storage=OperatorReadStorage([]), delivery=POLLING)
    assert lane.name == "lane"
    assert lane.capabilities.operator_reads is True
    assert lane.capabilities.production_durable is False
    assert lane.delivery.transport is None


def test_production_durable_lane_over_durable_shared_storage():
    storage = OperatorReadStorage([], profile=DURABLE_SHARED)
    lane = create_lane(storage=storage, delivery=POLLING, production_durable=True)
    assert lane.capabilities.production_durable is True
    assert lane.capabilities.process_local is False


def test_lanes_are_frozen():
    lane = create_lane(storage=OperatorReadStorage([]), delivery=POLLING)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lane.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lane.capabilities.operator_reads = False  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Delivery validation


def test_delivery_mode_strings_are_accepted():
    delivery = LaneDelivery(mode="transport", transport=RecordingTransport([]))  # type: ignore[arg-type]
    assert delivery.mode is LaneDeliveryMode.TRANSPORT


def test_transport_delivery_requires_a_transport():
    with invalid() as caught:
        LaneDelivery(mode=LaneDeliveryMode.TRANSPORT)
    assert "transport=" in caught.value.message


def test_storage_polling_rejects_a_transport():
    with invalid():
        LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING, transport=RecordingTransport([]))


def test_unknown_delivery_mode_is_rejected():
    with invalid():
        LaneDelivery(mode="carrier_pigeon")  # type: ignore[arg-type]


class NamelessTransport:
    async def publish_wakeups(self, command):
        return None


class SilentTransport:
    name = "silent"


class BrokenHookTransport(RecordingTransport):
    start = "not a method"  # type: ignore[assignment]


@pytest.mark.parametrize("transport", [NamelessTransport(), SilentTransport(), BrokenHookTransport([])])
def test_incomplete_transports_are_rejected(transport):
    with invalid():
        LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)


# ---------------------------------------------------------------------------------------------
# create_lane validation


class MissingQuery(NoHookStorage):
    query = None  # type: ignore[assignment]


class NoName(NoHookStorage):
    name = ""


class NoProfile(NoHookStorage):
    profile = {"durability": "durable"}  # type: ignore[assignment]


@pytest.mark.parametrize("storage", [object(), MissingQuery(), NoName(), NoProfile()])
def test_incomplete_storage_is_rejected(storage):
    with invalid():
        create_lane(storage=storage, delivery=POLLING, operator_reads=False)


def test_missing_storage_methods_are_named():
    with invalid() as caught:
        create_lane(storage=MissingQuery(), delivery=POLLING, operator_reads=False)
    assert "query" in caught.value.message


@pytest.mark.parametrize(
    "delivery", [{"mode": LaneDeliveryMode.STORAGE_POLLING}, LaneDeliveryMode.STORAGE_POLLING, None]
)
def test_delivery_must_be_a_lane_delivery(delivery):
    with invalid():
        create_lane(storage=OperatorReadStorage([]), delivery=delivery)


@pytest.mark.parametrize("name", ["", "   ", None, 5])
def test_lane_name_must_be_text(name):
    with invalid():
        create_lane(storage=OperatorReadStorage([]), delivery=POLLING, name=name)


@pytest.mark.parametrize("option", ["operator_reads", "production_durable"])
def test_capability_flags_must_be_booleans(option):
    with invalid():
        create_lane(storage=OperatorReadStorage([]), delivery=POLLING, **{option: "yes"})


def test_operator_reads_require_storage_that_provides_them():
    with invalid() as caught:
        create_lane(storage=RecordingStorage([]), delivery=POLLING)
    assert "operator_reads=False" in caught.value.message
    lane = create_lane(storage=RecordingStorage([]), delivery=POLLING, operator_reads=False)
    assert lane.capabilities.operator_reads is False


@pytest.mark.parametrize(
    "profile",
    [
        PROCESS_LOCAL,
        dataclasses.replace(DURABLE_SHARED, process_local=True),
        dataclasses.replace(DURABLE_SHARED, durability=StorageDurability.PROCESS),
    ],
)
def test_production_durable_requires_durable_process_shared_storage(profile):
    with invalid() as caught:
        create_lane(storage=OperatorReadStorage([], profile=profile), delivery=POLLING, production_durable=True)
    assert "production_durable=False" in caught.value.message


def test_unknown_options_are_rejected():
    with pytest.raises(TypeError):
        create_lane(storage=OperatorReadStorage([]), delivery=POLLING, durable=True)  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------
# The local lane


def test_local_lane_composes_fresh_in_memory_storage_with_polling():
    lane = local_lane()
    assert lane.name == "local"
    assert lane.delivery.mode is LaneDeliveryMode.STORAGE_POLLING and lane.delivery.transport is None
    assert lane.capabilities.operator_reads is True
    assert lane.capabilities.production_durable is False
    assert lane.capabilities.process_local is True
    assert lane.capabilities.storage is lane.storage.profile
    assert local_lane(name="tests").name == "tests"
    assert local_lane().storage is not lane.storage


async def test_local_lane_storage_uses_the_given_clock():
    clock = ControlledClock(datetime(2030, 5, 1, tzinfo=UTC))
    lane = local_lane(clock=clock)
    await lane.start()

    async def read_now(transaction):
        return await transaction.now()

    assert await lane.storage.with_transaction(read_now) == datetime(2030, 5, 1, tzinfo=UTC)
    await lane.close()


async def test_closed_local_lane_refuses_storage_work():
    lane = local_lane()
    await lane.start()
    await lane.close()
    with pytest.raises(RunlaneError) as caught:
        await lane.storage.get([])
    assert caught.value.code is ErrorCode.STORAGE_UNAVAILABLE


# ---------------------------------------------------------------------------------------------
# Lane composition conformance: the local lanes and a transport lane composed by hand


class TestLocalLaneComposition(LaneCompositionConformance):
    @pytest.fixture
    def lane(self) -> Lane:
        return local_lane()


class TestSqliteLaneComposition(LaneCompositionConformance):
    @pytest.fixture
    def lane(self, tmp_path: Path) -> Lane:
        return sqlite_lane(tmp_path / "conformance.db")


class TestRecordingTransportLaneComposition(LaneCompositionConformance):
    @pytest.fixture
    def lane(self) -> Lane:
        return create_lane(
            storage=local_storage_driver(),
            delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=RecordingWakeups()),
            name="recording",
        )


class _BoundTransport(RecordingWakeups):
    """A transport that lists its provider bindings, as a third-party one bound to its own queues does."""

    def __init__(self, *queues: object) -> None:
        super().__init__(name="bound")
        self.queues = queues


class TestTransportBoundToSeveralQueuesLaneComposition(LaneCompositionConformance):
    """A lane whose transport binds more queues than queue_name passes: the suite's runtime registers them all
    (it raised configuration_invalid: the transport binds a queue that is not registered)."""

    queue_name = "emails"

    @pytest.fixture
    def lane(self) -> Lane:
        from runlane import queue

        transport = _BoundTransport("emails", queue("reports", concurrency_limit=2))
        return create_lane(
            storage=local_storage_driver(), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
        )


def test_lane_composition_conformance_says_when_queue_name_is_not_bound() -> None:
    lane = create_lane(
        storage=local_storage_driver(),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=_BoundTransport("emails", "reports")),
    )
    with pytest.raises(AssertionError, match=r"binds 'emails', 'reports', not queue_name 'conformance.default'"):
        LaneCompositionConformance().test_a_triggered_run_is_woken_by_the_lane_delivery_mode_and_executes(lane)


class _Dishonest(LaneCompositionConformance):
    """A lane whose capabilities do not expose its storage profile: the suite must catch it."""

    @pytest.fixture
    def lane(self) -> Lane:
        honest = local_lane()
        wrong = dataclasses.replace(honest.capabilities, storage=dataclasses.replace(honest.capabilities.storage))
        return dataclasses.replace(honest, capabilities=wrong)


def test_lane_composition_conformance_can_fail() -> None:
    suite = _Dishonest()
    lane = suite.lane.__wrapped__(suite)  # the fixture function itself
    with pytest.raises(AssertionError, match="storage driver's own profile"):
        suite.test_capabilities_are_honest(lane)


def test_lane_composition_conformance_catches_a_transport_that_does_not_publish() -> None:
    transport = RecordingWakeups()
    transport.fail_next(1)
    lane = create_lane(
        storage=local_storage_driver(), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
    )
    with pytest.raises(AssertionError, match="did not take the wakeup"):
        LaneCompositionConformance().test_a_triggered_run_is_woken_by_the_lane_delivery_mode_and_executes(lane)


async def test_runtimes_sharing_a_lane_keep_it_open_until_the_last_one_closes():
    # A producer and a worker runtime over one lane (one process, or one test): the first to close must
    # not close the lane under the other.
    from runlane import RunStatus, create_runlane, queue, task
    from runlane_local import local_lane

    shared_queue = queue("shared", default=True)

    @task("lanes.shared")
    async def shared(payload: dict) -> int:
        return payload["n"]

    lane = local_lane()
    worker_side = create_runlane(lane=lane, queues=[shared_queue], tasks=[shared])
    async with worker_side:
        async with create_runlane(lane=lane, queues=[shared_queue], tasks=[shared]) as producer:
            await producer.trigger(shared, {"n": 1})
        second = (await worker_side.trigger(shared, {"n": 2})).run  # the lane is still open
        done = [await worker_side.execute_next(), await worker_side.execute_next()]
        assert [run.status for run in done] == [RunStatus.SUCCEEDED] * 2 and done[1].id == second.id
    with pytest.raises(RunlaneError) as caught:
        await lane.storage.get([])  # the last runtime closed it
    assert caught.value.code is ErrorCode.STORAGE_UNAVAILABLE
