"""runlane-sqs: SQS wakeups for Runlane, for teams that outgrow polling.

* ``sqs_queue(queue, queue_url=... | queue_name=..., fifo=...)``: binds a Runlane queue to an SQS queue;
* ``sqs_transport(client=boto3.client("sqs"), queues=[...])``: publishes one SQS message per outbox row;
* ``postgres_sqs_lane(postgres={...}, sqs={...})``: Postgres storage plus that transport, the
  ``postgres-sqs`` lane of ``runlane.toml``;
* ``create_sqs_delivery_consumer(...)``: a long-running receive loop calling
  ``runlane.execute_delivery`` (``runlane sqs consume`` runs one per bound queue);
* ``create_sqs_lambda_handler(...)``: the same for an AWS Lambda SQS event source, with partial
  batch failures;
* ``encode_sqs_wakeup_body`` / ``parse_sqs_wakeup_body``: the versioned ``runlane.wakeup`` envelope.

SQS only wakes consumers: payloads, state, leases, retries and schedules stay in storage.
"""

from __future__ import annotations

from .bindings import (
    SqsFifoDeduplication,
    SqsFifoMessageGroup,
    SqsFifoOptions,
    SqsQueueBinding,
    SqsQueueSourceType,
    sqs_queue,
)
from .consumer import SqsConsumerCounts, SqsDeliveryConsumer, create_sqs_delivery_consumer
from .delivery import SqsDeliveryFailure, SqsDeliveryFailurePhase
from .envelope import WAKEUP_TYPE, WAKEUP_VERSION, encode_sqs_wakeup_body, parse_sqs_wakeup_body
from .lambda_handler import SqsLambdaHandler, create_sqs_lambda_handler
from .lane import postgres_sqs_lane
from .transport import SqsTransport, sqs_transport

__all__ = [
    "WAKEUP_TYPE",
    "WAKEUP_VERSION",
    "SqsConsumerCounts",
    "SqsDeliveryConsumer",
    "SqsDeliveryFailure",
    "SqsDeliveryFailurePhase",
    "SqsFifoDeduplication",
    "SqsFifoMessageGroup",
    "SqsFifoOptions",
    "SqsLambdaHandler",
    "SqsQueueBinding",
    "SqsQueueSourceType",
    "SqsTransport",
    "create_sqs_delivery_consumer",
    "create_sqs_lambda_handler",
    "encode_sqs_wakeup_body",
    "parse_sqs_wakeup_body",
    "postgres_sqs_lane",
    "sqs_queue",
    "sqs_transport",
]
