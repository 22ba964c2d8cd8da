"""Lane composition: one storage driver plus an explicit delivery mode, started and closed in a fixed order.

``create_lane()`` validates adapter shapes and capability claims, keeps the original adapter instances
and reports what the composition provides through ``lane.capabilities``. It is not a capability shim:
it never makes storage durable, adds operator reads, or invents a transport for a polling lane.
Publishing wakeups (the outbox) is not done here; ``TransportAdapter`` only fixes the adapter's shape.

Lifecycle order: ``start()`` starts storage, then the transport (closing storage again if the
transport fails to start); ``close()`` closes the transport, then storage.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import ErrorCode, RunlaneError
from ..storage import StorageDriver, StorageDurability, StorageProfile, supports_operator_reads
from ..vocabulary import LaneDeliveryMode

__all__ = ["Lane", "LaneCapabilities", "LaneDelivery", "TransportAdapter", "TransportCapabilities", "create_lane"]

_STORAGE_METHODS = ("get", "query", "with_transaction")
_DELIVERY_FORMS = (
    "LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING) or "
    "LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=...)"
)


@dataclass(frozen=True, slots=True)
class TransportCapabilities:
    """What a transport's provider promises about the wakeups it accepted.

    ``durable_delivery``: accepted wakeups survive the adapter's process until delivered or redriven.
    ``message_grouping``: wakeups are grouped for provider FIFO semantics. ``native_delay``: the
    provider can hold future wakeups (Runlane keeps due times in storage either way).
    ``ordered_delivery``: provider order is kept for the configured queue set.
    """

    durable_delivery: bool = False
    message_grouping: bool = False
    native_delay: bool = False
    ordered_delivery: bool = False


@runtime_checkable
class TransportAdapter(Protocol):
    """Publishes wakeups for claimed outbox rows; never owns durable run state.

    Optional hooks, called by the lane when present (plain or ``async``): ``start()`` and ``close()``.
    A transport may also expose ``queues`` (the queue definitions or names it binds; the runtime
    checks them against its registry) and ``capabilities`` (a ``TransportCapabilities``).
    """

    name: str

    async def publish_wakeups(self, command: Any) -> Any: ...


def _invalid(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message)


def _check_hooks(adapter: object, what: str) -> None:
    for hook in ("start", "close"):
        value = getattr(adapter, hook, None)
        if value is not None and not callable(value):
            raise _invalid(f"{what}: {hook} must be a method when present.")


def _check_transport(transport: object) -> None:
    name = getattr(transport, "name", None)
    if not isinstance(name, str) or not name:
        raise _invalid(f"The transport {transport!r} needs a non-empty string name.")
    if not callable(getattr(transport, "publish_wakeups", None)):
        raise _invalid(f"Transport {name!r} is not a TransportAdapter: it has no publish_wakeups(command) method.")
    _check_hooks(transport, f"Transport {name!r}")


@dataclass(frozen=True, slots=True)
class LaneDelivery:
    """How runs reach workers: storage polling, or wakeups published through ``transport``.

    ``transport`` is required for ``TRANSPORT`` mode and must be omitted for ``STORAGE_POLLING``.
    """

    mode: LaneDeliveryMode
    transport: TransportAdapter | None = None

    def __post_init__(self) -> None:
        try:
            mode = LaneDeliveryMode(self.mode)
        except ValueError:
            raise _invalid(f"Unknown lane delivery mode {self.mode!r}; use {_DELIVERY_FORMS}.") from None
        if mode is LaneDeliveryMode.TRANSPORT:
            if self.transport is None:
                raise _invalid(
                    "Transport delivery needs a transport: "
                    "LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=...)."
                )
            _check_transport(self.transport)
        elif self.transport is not None:
            raise _invalid(
                "Storage polling takes no transport; remove transport= or use mode=LaneDeliveryMode.TRANSPORT."
            )
        object.__setattr__(self, "mode", mode)


@dataclass(frozen=True, slots=True)
class LaneCapabilities:
    """What a lane honestly provides; ``storage`` is the storage driver's own profile."""

    operator_reads: bool
    production_durable: bool
    process_local: bool
    storage: StorageProfile


@dataclass(frozen=True, eq=False)
class Lane:
    """A storage driver plus a delivery mode. Build it with ``create_lane()`` or a lane package."""

    name: str
    storage: StorageDriver
    delivery: LaneDelivery
    capabilities: LaneCapabilities
    # Runtimes that started this lane and have not closed it yet: several runtimes may share one lane
    # (a producer and a worker in one process, or in one test), and it closes with the last of them.
    _holders: int = field(default=0, init=False, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"Lane(name={self.name!r}, storage={self.storage.name!r}, delivery={self.delivery.mode.value!r})"

    async def start(self) -> None:
        """Start storage, then the transport; if the transport fails to start, close storage again.
        A lane another runtime has started (and not closed) is already started: it only counts one more."""
        holders = self._holders
        object.__setattr__(self, "_holders", holders + 1)
        if holders:
            return
        try:
            await self._start()
        except BaseException:
            object.__setattr__(self, "_holders", self._holders - 1)
            raise

    async def _start(self) -> None:
        await _call_hook(self.storage, "start")
        transport = self.delivery.transport
        if transport is None:
            return
        try:
            await _call_hook(transport, "start")
        except BaseException as error:
            try:
                await _call_hook(self.storage, "close")
            except Exception as close_error:
                error.add_note(f"Closing storage after the failed transport start also failed: {close_error!r}")
            raise

    async def close(self) -> None:
        """Close the transport, then storage (storage is closed even when the transport fails to close),
        once every runtime that started the lane has closed it."""
        if self._holders > 1:
            object.__setattr__(self, "_holders", self._holders - 1)
            return
        object.__setattr__(self, "_holders", 0)
        transport = self.delivery.transport
        try:
            if transport is not None:
                await _call_hook(transport, "close")
        except BaseException as error:
            try:
                await _call_hook(self.storage, "close")
            except Exception as close_error:
                error.add_note(f"Closing storage also failed: {close_error!r}")
            raise
        await _call_hook(self.storage, "close")


async def _call_hook(adapter: object, hook: str) -> None:
    method = getattr(adapter, hook, None)
    if method is None:
        return
    result = method()
    if inspect.isawaitable(result):
        await result


def _check_storage(storage: object, lane: str) -> StorageProfile:
    missing = [method for method in _STORAGE_METHODS if not callable(getattr(storage, method, None))]
    if missing:
        raise _invalid(
            f"Lane {lane!r}: storage is not a StorageDriver (missing {', '.join(missing)}); "
            "pass a storage driver such as local_storage_driver()."
        )
    name = getattr(storage, "name", None)
    if not isinstance(name, str) or not name:
        raise _invalid(f"Lane {lane!r}: the storage driver needs a non-empty string name.")
    profile = getattr(storage, "profile", None)
    if not isinstance(profile, StorageProfile):
        raise _invalid(f"Lane {lane!r}: storage {name!r} needs a StorageProfile as its profile, got {profile!r}.")
    _check_hooks(storage, f"Storage {name!r}")
    return profile


def create_lane(
    *,
    storage: StorageDriver,
    delivery: LaneDelivery,
    name: str = "lane",
    operator_reads: bool = True,
    production_durable: bool = False,
) -> Lane:
    """Compose ``storage`` with an explicit ``delivery`` mode into a ``Lane``.

    ``operator_reads=True`` requires a storage driver with operator reads; ``production_durable=True``
    requires durable storage that other processes can reach (not process-local).
    """
    if not isinstance(name, str) or not name.strip():
        raise _invalid(f"A lane name must be a non-empty string, got {name!r}.")
    profile = _check_storage(storage, name)
    if not isinstance(delivery, LaneDelivery):
        raise _invalid(f"Lane {name!r}: delivery must be {_DELIVERY_FORMS}, got {delivery!r}.")
    for option, value in (("operator_reads", operator_reads), ("production_durable", production_durable)):
        if not isinstance(value, bool):
            raise _invalid(f"Lane {name!r}: {option} must be True or False, got {value!r}.")
    if operator_reads and not supports_operator_reads(storage):
        raise _invalid(
            f"Lane {name!r}: storage {storage.name!r} has no operator reads (get_run, list_runs, list_run_events); "
            "pass operator_reads=False or use a driver that provides them."
        )
    if production_durable and (profile.durability is not StorageDurability.DURABLE or profile.process_local):
        found = "process-local" if profile.process_local else f"{profile.durability.value} durability"
        raise _invalid(
            f"Lane {name!r}: production_durable=True needs durable storage shared across processes, "
            f"but storage {storage.name!r} is {found}; pass production_durable=False."
        )
    capabilities = LaneCapabilities(
        operator_reads=operator_reads,
        production_durable=production_durable,
        process_local=profile.process_local,
        storage=profile,
    )
    return Lane(name=name, storage=storage, delivery=delivery, capabilities=capabilities)
