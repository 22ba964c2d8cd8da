"""SQS queue bindings: which SQS queue carries the wakeups of one Runlane queue, and how.

``sqs_queue(queue, queue_url=... | queue_name=..., fifo=...)`` binds a registered queue (its
``QueueDefinition``, or its name) to exactly one SQS queue. The queue definition owns routing and
durable capacity; the binding owns the provider URL or name and the FIFO fields. Every option is
checked here, when the binding is built, so a typo fails at startup rather than at the first publish.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from runlane.core.authoring import QueueDefinition
from runlane.errors import ErrorCode, RunlaneError
from runlane.ids import validate_id

__all__ = [
    "SqsFifoDeduplication",
    "SqsFifoMessageGroup",
    "SqsFifoOptions",
    "SqsQueueBinding",
    "SqsQueueSourceType",
    "sqs_queue",
]

# SQS queue names: 1-80 characters of letters, digits, '-' and '_'; a FIFO queue's name ends in '.fifo'.
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,75}(\.fifo)?|[A-Za-z0-9_-]{76,80}")
_ACCOUNT_ID = re.compile(r"[0-9]{12}")
FIFO_SUFFIX = ".fifo"
SQS_MAX_WAIT_TIME_SECONDS = 20  # the longest long poll of a ReceiveMessage call


def invalid(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta)


def check_client(client: object, methods: Sequence[str], what: str) -> None:
    """``client`` has every method in ``methods`` (a boto3 SQS client or the same surface)."""
    missing = [method for method in methods if not callable(getattr(client, method, None))]
    if client is None or missing:
        raise invalid(
            f"{what} needs an SQS client such as boto3.client('sqs'), got {client!r}"
            + (f" (it has no {', '.join(missing)})." if client is not None else "."),
            field="client",
        )


def check_count(value: object, what: str, low: int, high: int) -> int:
    """``value`` as an integer from ``low`` to ``high``, else ``configuration_invalid`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(f"{what} must be an integer from {low} to {high}, got {value!r}.", field=what)
    return value


class SqsFifoMessageGroup(enum.StrEnum):
    """``MessageGroupId`` of a FIFO wakeup: per run (one stuck run blocks nothing else) or per queue."""

    RUN = "run"
    QUEUE = "queue"


class SqsFifoDeduplication(enum.StrEnum):
    """``MessageDeduplicationId`` of a FIFO wakeup: derived from its outbox row, or left to the queue's
    content-based deduplication (which must then be enabled on the queue)."""

    OUTBOX = "outbox"
    CONTENT_BASED = "content_based"


class SqsQueueSourceType(enum.StrEnum):
    """How a binding names its SQS queue."""

    QUEUE_URL = "queue_url"
    QUEUE_NAME = "queue_name"


@dataclass(frozen=True, slots=True)
class SqsFifoOptions:
    """FIFO settings of one binding; the defaults are what most FIFO queues want."""

    message_group: SqsFifoMessageGroup = SqsFifoMessageGroup.RUN
    deduplication: SqsFifoDeduplication = SqsFifoDeduplication.OUTBOX

    def __post_init__(self) -> None:
        object.__setattr__(self, "message_group", _member(SqsFifoMessageGroup, self.message_group, "message_group"))
        object.__setattr__(self, "deduplication", _member(SqsFifoDeduplication, self.deduplication, "deduplication"))


def _member(kind: type[enum.StrEnum], value: Any, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in kind)
        raise invalid(f"fifo {what} must be one of {choices}, got {value!r}.", field=f"fifo.{what}") from None


@dataclass(frozen=True, slots=True)
class SqsQueueBinding:
    """One Runlane queue bound to one SQS queue. Build it with ``sqs_queue()``.

    ``queue`` is the bound ``QueueDefinition`` (or the queue's name when bound by name); ``source_type``
    says whether ``source`` is a queue URL or a queue name to resolve.
    """

    queue: QueueDefinition | str
    source_type: SqsQueueSourceType
    source: str
    queue_owner_aws_account_id: str | None = None
    fifo: SqsFifoOptions | None = None

    @property
    def queue_name(self) -> str:
        """The Runlane queue's name."""
        return self.queue if isinstance(self.queue, str) else self.queue.name

    @property
    def is_fifo(self) -> bool:
        return self.fifo is not None


def _fifo_options(fifo: object) -> SqsFifoOptions | None:
    if fifo is None or fifo is False:
        return None
    if fifo is True:
        return SqsFifoOptions()
    if isinstance(fifo, SqsFifoOptions):
        return fifo
    if isinstance(fifo, dict):
        unknown = sorted(set(fifo) - {"message_group", "deduplication"})
        if unknown:
            raise invalid(
                f"Unknown fifo option {unknown[0]!r}; the options are 'message_group' and 'deduplication'.",
                field="fifo",
            )
        return SqsFifoOptions(**fifo)
    raise invalid(
        f"fifo must be True, a dict or SqsFifoOptions(...), got {fifo!r}.",
        field="fifo",
    )


def _queue_url(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"queue_url must be a non-empty string, got {value!r}.", field="queue_url")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc or not parts.path.strip("/"):
        raise invalid(
            f"queue_url {value!r} is not an SQS queue URL; it looks like "
            "https://sqs.us-east-1.amazonaws.com/123456789012/my-queue.",
            field="queue_url",
        )
    return value


def _sqs_queue_name(value: object) -> str:
    if not isinstance(value, str) or not _QUEUE_NAME.fullmatch(value):
        raise invalid(
            f"queue_name {value!r} is not a valid SQS queue name: 1-80 letters, digits, '-' or '_', "
            "and a FIFO queue's name ends in '.fifo'.",
            field="queue_name",
        )
    return value


def sqs_queue(
    queue: QueueDefinition | str,
    *,
    queue_url: str | None = None,
    queue_name: str | None = None,
    queue_owner_aws_account_id: str | None = None,
    fifo: SqsFifoOptions | dict[str, Any] | bool | None = None,
) -> SqsQueueBinding:
    """Bind ``queue`` to an SQS queue given by exactly one of ``queue_url`` or ``queue_name``.

    ``queue_name`` is resolved with ``GetQueueUrl`` on first publish and cached;
    ``queue_owner_aws_account_id`` (only with ``queue_name``) resolves a queue of another account.
    ``fifo`` (``True``, ``{"message_group": "run" | "queue", "deduplication": "outbox" |
    "content_based"}`` or ``SqsFifoOptions``) is required for a queue whose URL or name ends in
    ``.fifo`` and refused for any other.
    """
    if isinstance(queue, QueueDefinition):
        bound: QueueDefinition | str = queue
        label = queue.name
    elif isinstance(queue, str):
        bound = label = validate_id(queue, "queue name")
    else:
        raise invalid(f"sqs_queue() binds a queue(...) definition or a queue name, got {queue!r}.", field="queue")
    if (queue_url is None) == (queue_name is None):
        raise invalid(
            f"SQS binding of queue {label!r}: pass exactly one of queue_url or queue_name.",
            field="queue_url",
            queue=label,
        )
    fifo_options = _fifo_options(fifo)
    if queue_url is not None:
        if queue_owner_aws_account_id is not None:
            raise invalid(
                f"SQS binding of queue {label!r}: queue_owner_aws_account_id only applies with queue_name; "
                "a queue URL already names its account.",
                field="queue_owner_aws_account_id",
                queue=label,
            )
        source_type, source = SqsQueueSourceType.QUEUE_URL, _queue_url(queue_url)
        provider_name = urlsplit(source).path.rstrip("/").rsplit("/", 1)[-1]
    else:
        source_type, source = SqsQueueSourceType.QUEUE_NAME, _sqs_queue_name(queue_name)
        provider_name = source
        if queue_owner_aws_account_id is not None and (
            not isinstance(queue_owner_aws_account_id, str) or not _ACCOUNT_ID.fullmatch(queue_owner_aws_account_id)
        ):
            raise invalid(
                f"SQS binding of queue {label!r}: queue_owner_aws_account_id must be a 12-digit AWS account id, "
                f"got {queue_owner_aws_account_id!r}.",
                field="queue_owner_aws_account_id",
                queue=label,
            )
    is_fifo_queue = provider_name.endswith(FIFO_SUFFIX)
    if is_fifo_queue and fifo_options is None:
        raise invalid(
            f"SQS binding of queue {label!r}: {provider_name!r} is a FIFO queue; pass fifo=True "
            "(fifo = true in runlane.toml, or fifo options) so wakeups carry a message group and deduplication id.",
            field="fifo",
            queue=label,
        )
    if not is_fifo_queue and fifo_options is not None:
        raise invalid(
            f"SQS binding of queue {label!r}: fifo options need a FIFO queue, whose name ends in '.fifo'; "
            f"{provider_name!r} is a standard queue. Remove fifo or bind the FIFO queue.",
            field="fifo",
            queue=label,
        )
    return SqsQueueBinding(
        queue=bound,
        source_type=source_type,
        source=source,
        queue_owner_aws_account_id=queue_owner_aws_account_id,
        fifo=fifo_options,
    )
