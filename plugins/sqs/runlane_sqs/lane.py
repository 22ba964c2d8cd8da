"""The ``postgres-sqs`` lane: Postgres holds every durable fact, SQS carries the wakeups.

Each trigger on an unbounded queue (and each bounded-queue dispatch ``tick()`` reserves) writes an
outbox row in the same Postgres transaction as the run; core claims the row and publishes one SQS
message for it. SQS consumers (``create_sqs_delivery_consumer()``, ``create_sqs_lambda_handler()``
or ``runlane sqs consume``) then call ``runlane.execute_delivery(message)``. ``tick()``, run from
separate maintenance, republishes failed or unpublished rows, recovers expired leases and does the rest
of the maintenance.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from runlane.core.lanes import Lane, LaneDelivery, create_lane
from runlane.vocabulary import LaneDeliveryMode

from .bindings import invalid
from .transport import SqsTransport, sqs_transport

__all__ = ["postgres_sqs_lane"]


def _nested(options: object, what: str, factory: Callable[..., Any]) -> dict[str, Any]:
    """Keyword arguments for ``factory``; a key it does not take is refused by name."""
    if not isinstance(options, Mapping):
        raise invalid(f"postgres_sqs_lane() needs {what}={{...}}, the options of {factory.__name__}().", field=what)
    parameters = inspect.signature(factory).parameters
    accepted = [name for name, parameter in parameters.items() if parameter.kind is not parameter.VAR_KEYWORD]
    unknown = sorted(key for key in options if key not in accepted)
    if unknown:
        raise invalid(
            f"Unknown {what} option {unknown[0]!r} of postgres_sqs_lane(); {factory.__name__}() takes "
            f"{', '.join(accepted)}.",
            field=f"{what}.{unknown[0]}",
        )
    missing = [
        name
        for name, parameter in parameters.items()
        if parameter.default is parameter.empty and parameter.kind is not parameter.VAR_KEYWORD and name not in options
    ]
    if missing:
        raise invalid(f"postgres_sqs_lane() needs {what}={{{missing[0]!r}: ...}}.", field=f"{what}.{missing[0]}")
    return dict(options)


def postgres_sqs_lane(
    *,
    postgres: Mapping[str, Any],
    sqs: Mapping[str, Any] | SqsTransport,
    name: str = "postgres-sqs",
) -> Lane:
    """A production-durable lane: ``postgres_storage(**postgres)`` plus ``sqs_transport(**sqs)``.

    ``postgres`` takes the options of ``postgres_storage()`` (``connection_string``, ``schema``, pool
    sizes, timeouts); ``sqs`` those of ``sqs_transport()`` (``client``, ``queues``, ``batch_size``,
    ``name``), or an ``SqsTransport`` already built. Apply the Postgres migration first: ``start()``
    probes the schema and fails fast. ``create_runlane()`` checks that the transport binds exactly
    the registered queues.
    """
    from runlane_postgres.storage import postgres_storage

    if not isinstance(name, str) or not name.strip():
        raise invalid(f"A lane name must be a non-empty string, got {name!r}.", field="name")
    postgres_options = _nested(postgres, "postgres", postgres_storage)
    if isinstance(sqs, SqsTransport):
        transport = sqs
    else:
        transport = sqs_transport(**_nested(sqs, "sqs", sqs_transport))
    storage = postgres_storage(**postgres_options)
    return create_lane(
        storage=storage,
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
        name=name,
        operator_reads=True,
        production_durable=True,
    )
