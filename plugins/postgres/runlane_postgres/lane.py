"""The ``postgres-polling`` lane: Postgres storage with storage-polling workers and no transport."""

from __future__ import annotations

from runlane.core.lanes import Lane, LaneDelivery, create_lane
from runlane.vocabulary import LaneDeliveryMode

from .storage import Clock, postgres_storage

__all__ = ["postgres_polling_lane"]


def postgres_polling_lane(
    connection_string: str,
    *,
    schema: str | None = None,
    name: str = "postgres-polling",
    min_size: int = 1,
    max_size: int = 10,
    clock: Clock | None = None,
    connect_timeout: float = 10.0,
    statement_timeout: float | None = 30.0,
    pool_timeout: float = 30.0,
) -> Lane:
    """A production-durable lane over Postgres: workers poll storage; no outbox rows, no wakeups.

    ``connection_string`` and ``schema`` are resolved like ``postgres_storage`` (explicit ``schema``,
    then ``?schema=`` in the URL, then ``public``). Apply the migration first (``runlane postgres
    migrate``): ``lane.start()`` probes the schema and fails fast when it is missing. ``clock`` is for
    tests; a runtime created with ``create_runlane(clock=...)`` hands its clock to the storage itself.
    """
    storage = postgres_storage(
        connection_string,
        schema=schema,
        min_size=min_size,
        max_size=max_size,
        clock=clock,
        connect_timeout=connect_timeout,
        statement_timeout=statement_timeout,
        pool_timeout=pool_timeout,
    )
    return create_lane(
        storage=storage,
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        name=name,
        operator_reads=True,
        production_durable=True,
    )
