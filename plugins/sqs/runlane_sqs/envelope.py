"""The SQS message body of a Runlane wakeup: a versioned ``runlane.wakeup`` envelope around one
``DeliveryMessage``.

Version 1::

    {"type": "runlane.wakeup", "version": 1,
     "message": {"environment": {"name": "production"}, "run_id": "run_...", "queue": "emails",
                 "requested_at": "2026-11-30T07:35:10.123456Z", "trace_carrier": {...}}}

It carries only what finds the durable run again: no payload, no output, no run state. One outbox
row is one message; several wakeups are never bundled into one body, so SQS visibility, Lambda partial
batch failures, FIFO deduplication and Runlane leases all work on the same unit, one run's wakeup.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from runlane.errors import ErrorCode, RunlaneError, pydantic_message
from runlane.json_values import canonical_json, json_escape_char
from runlane.models import DeliveryMessage

__all__ = ["WAKEUP_TYPE", "WAKEUP_VERSION", "encode_sqs_wakeup_body", "parse_sqs_wakeup_body"]

WAKEUP_TYPE = "runlane.wakeup"
WAKEUP_VERSION = 1

# Longer than any wakeup Runlane writes, no longer than the 256 KiB body SQS has long allowed. A real
# wakeup takes a few hundred characters, but a trace carrier may hold 16 KiB, and JSON writes a control
# character as a six-character \u escape: the largest carrier trigger() accepts takes about 135,000.
_MAX_BODY_CHARS = 256 * 1024

# SQS takes only #x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF in a body, and refuses
# (or replaces with U+FFFD) the rest. JSON escapes control characters, and ids hold no lone surrogates: the
# noncharacters U+FFFE and U+FFFF, which an id or a trace carrier may hold, are written as \u escapes.
_NOT_SQS_TEXT = re.compile("[\ufffe\uffff]")


def encode_sqs_wakeup_body(message: DeliveryMessage) -> str:
    """The ``MessageBody`` that carries ``message`` (canonical JSON: sorted keys, no whitespace)."""
    if not isinstance(message, DeliveryMessage):
        raise RunlaneError(
            ErrorCode.ADAPTER_CONTRACT_VIOLATION,
            f"A wakeup body wraps a DeliveryMessage, got {type(message).__name__}.",
        )
    body = canonical_json({"type": WAKEUP_TYPE, "version": WAKEUP_VERSION, "message": message.to_json()})
    return _NOT_SQS_TEXT.sub(json_escape_char, body)


def _not_a_wakeup(reason: str) -> RunlaneError:
    return RunlaneError(
        ErrorCode.VALIDATION_FAILED,
        f"The SQS message is not a Runlane wakeup: {reason}. Runlane queues carry only runlane.wakeup bodies; "
        "leave the message to the queue's redrive policy.",
        meta={"envelope": WAKEUP_TYPE},
    )


def parse_sqs_wakeup_body(body: object) -> DeliveryMessage:
    """The ``DeliveryMessage`` in an SQS ``MessageBody``; ``validation_failed`` when it is not a wakeup.

    The envelope is checked whole: type, version, no unknown keys, and the message itself as a
    ``DeliveryMessage`` (``requested_at`` back to an aware UTC ``datetime``).
    """
    if isinstance(body, bytes):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError:
            raise _not_a_wakeup("the body is not UTF-8 text") from None
    if not isinstance(body, str):
        raise _not_a_wakeup(f"the body is {type(body).__name__}, not text")
    if len(body) > _MAX_BODY_CHARS:
        raise _not_a_wakeup(f"the body has {len(body)} characters, more than any wakeup")
    try:
        envelope: Any = json.loads(body)
    except ValueError:
        raise _not_a_wakeup("the body is not JSON") from None
    except RecursionError:  # "[[[[..." within the size cap: anyone who may send to the queue can write it
        raise _not_a_wakeup("the body nests deeper than JSON can be read") from None
    if not isinstance(envelope, dict):
        raise _not_a_wakeup("the body is not a JSON object")
    if envelope.get("type") != WAKEUP_TYPE:
        raise _not_a_wakeup(f"its type is {envelope.get('type')!r}, not {WAKEUP_TYPE!r}")
    version = envelope.get("version")
    if version != WAKEUP_VERSION or isinstance(version, bool):
        raise _not_a_wakeup(
            f"its version is {version!r}; this Runlane reads version {WAKEUP_VERSION} (upgrade the consumer "
            "if a newer producer wrote it)"
        )
    unknown = sorted(set(envelope) - {"type", "version", "message"})
    if unknown:
        raise _not_a_wakeup(f"it has unknown key {unknown[0]!r}")
    try:
        return DeliveryMessage.model_validate(envelope.get("message"))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(["message", *(str(part) for part in first["loc"])])
        raise _not_a_wakeup(f"{where}: {pydantic_message(first)}") from None
