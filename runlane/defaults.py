"""``contract_defaults``: the shared defaults every runtime, driver and tool applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from .models import Actor
from .vocabulary import ActorType, RunEventSortField, RunSortField, SortDirection, TriggerDispatchMode

__all__ = ["contract_defaults"]


@dataclass(frozen=True)
class _RunDefaults:
    new_event_sequence: int = 0


@dataclass(frozen=True)
class _LeaseDefaults:
    duration: timedelta = timedelta(minutes=5)


@dataclass(frozen=True)
class _RetryDefaults:
    backoff: str = "30s"


@dataclass(frozen=True)
class _IdempotencyDefaults:
    ttl: str = "30d"


@dataclass(frozen=True)
class _PaginationDefaults:
    default_limit: int = 50
    max_limit: int = 100


@dataclass(frozen=True)
class _MaintenanceDefaults:
    schedule_materialization_limit: int = 100
    cancellation_finalization_limit: int = 100
    timeout_finalization_limit: int = 100
    dispatch_reservation_limit: int = 100
    delivery_request_limit: int = 100
    outbox_claim_limit: int = 100


@dataclass(frozen=True)
class _PruningDefaults:
    batch_limit: int = 100


@dataclass(frozen=True)
class _SortDefault:
    field: str
    direction: SortDirection


@dataclass(frozen=True)
class _SortDefaults:
    runs: _SortDefault = _SortDefault(RunSortField.CREATED_AT, SortDirection.DESC)
    run_events: _SortDefault = _SortDefault(RunEventSortField.OCCURRED_AT, SortDirection.ASC)


@dataclass(frozen=True)
class _ActorDefaults:
    system: Actor = field(default_factory=lambda: Actor(type=ActorType.SYSTEM))
    operator: Actor = field(default_factory=lambda: Actor(type=ActorType.OPERATOR))


@dataclass(frozen=True)
class _DispatchDefaults:
    on_trigger: TriggerDispatchMode = TriggerDispatchMode.EAGER


@dataclass(frozen=True)
class _ContractDefaults:
    queue: str = "default"
    environment: str = "default"
    run: _RunDefaults = _RunDefaults()
    lease: _LeaseDefaults = _LeaseDefaults()
    retry: _RetryDefaults = _RetryDefaults()
    idempotency: _IdempotencyDefaults = _IdempotencyDefaults()
    pagination: _PaginationDefaults = _PaginationDefaults()
    maintenance: _MaintenanceDefaults = _MaintenanceDefaults()
    pruning: _PruningDefaults = _PruningDefaults()
    sort: _SortDefaults = _SortDefaults()
    actor: _ActorDefaults = field(default_factory=_ActorDefaults)
    dispatch: _DispatchDefaults = _DispatchDefaults()


contract_defaults = _ContractDefaults()
