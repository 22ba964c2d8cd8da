"""``sqs_transport()``: publishes Runlane wakeups to SQS, one message per claimed outbox row.

Core claims outbox rows and hands them over as one ``PublishWakeupsCommand``. The transport groups
the attempts by SQS queue, sends ``SendMessageBatch`` chunks of at most ``batch_size`` entries
(concurrently, each in a worker thread for a blocking boto3 client) and answers with
``outcomes[index]`` for ``command.attempts[index]``:

- an entry SQS accepted is ``published`` (``provider_message_id`` is the SQS ``MessageId``);
- an entry SQS rejected is ``failed`` with ``transport_publish_failed``, retryable unless SQS says
  the sender is at fault; the provider's code and request id go in the failure's ``meta``;
- a chunk whose call failed as a whole is ``failed`` with that call's error; when no chunk got through
  at all, the call raises that error instead (``transport_unavailable`` for throttling, 5xx and
  network failures, ``transport_publish_failed`` for refusals);
- a ``queue_name`` that cannot be resolved (no such queue, no region or credentials) refuses the whole
  call with ``configuration_invalid`` naming the binding to fix, before anything is sent: a trigger
  with eager dispatch rejects, and ``tick()`` reports it until the configuration is fixed (the claimed
  rows are published again once their claim expires);
- a bound ``queue_url`` that does not exist fails the attempts of that queue only, with a retryable
  ``transport_publish_failed``: the other queues' wakeups go out, and the rows are retried with
  backoff (up to 5 minutes apart) for as long as the queue is missing, never given up: a queue
  created meanwhile gets them;
- an answer whose entry ids do not match the request raises: its outcomes are not trustworthy.

SQS delay is never used: storage decides when work is due. The transport owns no durable state and
never reads storage; its client belongs to the caller, who closes it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from runlane.core.authoring import QueueDefinition
from runlane.core.lanes import TransportCapabilities
from runlane.core.transport import (
    PublishWakeupsCommand,
    PublishWakeupsResult,
    WakeupPublishAttempt,
    validate_publish_wakeups_command,
)
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import OutboxFailureRecord, WakeupPublishOutcome
from runlane.vocabulary import WakeupPublishOutcomeType

from .aws import call_sqs, classify_provider_error
from .bindings import (
    SqsFifoDeduplication,
    SqsFifoMessageGroup,
    SqsQueueBinding,
    SqsQueueSourceType,
    check_client,
    check_count,
    invalid,
)
from .envelope import encode_sqs_wakeup_body

__all__ = ["SQS_MAX_BATCH_SIZE", "SqsTransport", "sqs_transport"]

SQS_MAX_BATCH_SIZE = 10


def deduplication_id(outbox_message_id: str) -> str:
    """A provider-safe ``MessageDeduplicationId`` for one outbox row (64 hex characters)."""
    return hashlib.sha256(outbox_message_id.encode("utf-8")).hexdigest()


# What SQS accepts as a MessageGroupId: 1 to 128 ASCII letters, digits and punctuation (no space).
_GROUP_ID_CHARACTERS = frozenset(chr(code) for code in range(0x21, 0x7F))
_MAX_GROUP_ID = 128


def message_group_id(value: str) -> str:
    """The ``MessageGroupId`` of a FIFO wakeup grouped by ``value`` (a run id or a queue name): the value
    itself when SQS accepts it, else its sha256 (64 hex characters), so that every run id and queue name
    Runlane allows (up to 512 characters, spaces, any script) can be published, each to a group of its own."""
    if 0 < len(value) <= _MAX_GROUP_ID and _GROUP_ID_CHARACTERS.issuperset(value):
        return value
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def _publish_failure(error: RunlaneError) -> RunlaneError:
    """``error`` of a ``SendMessageBatch`` call as a publish failure: a bound URL whose queue does not
    exist, or a client without a region or credentials, is a retryable ``transport_publish_failed``
    (its message says what to fix), so the outbox retries it with backoff."""
    if error.code in (ErrorCode.TRANSPORT_UNAVAILABLE, ErrorCode.TRANSPORT_PUBLISH_FAILED):
        return error
    return RunlaneError(
        ErrorCode.TRANSPORT_PUBLISH_FAILED,
        error.message,
        retryable=True,
        meta={**(error.meta or {}), "cause_code": error.code.value},
    )


class _CallFailed(RunlaneError):
    """A ``SendMessageBatch`` call that failed as a whole: its attempts get this failure as their outcome."""

    def __init__(self, failure: RunlaneError) -> None:
        super().__init__(failure.code, failure.message, retryable=failure.retryable, meta=failure.meta)


@dataclass(frozen=True, slots=True)
class _Chunk:
    queue_url: str
    binding: SqsQueueBinding
    indexes: tuple[int, ...]


class SqsTransport:
    """A ``TransportAdapter`` over SQS. Build it with ``sqs_transport()``.

    ``bindings`` are the ``sqs_queue()`` bindings; ``queues`` the bound queue definitions (or names),
    which ``create_runlane()`` checks against its registry; ``capabilities`` what SQS promises.
    """

    def __init__(self, *, client: Any, bindings: tuple[SqsQueueBinding, ...], batch_size: int, name: str) -> None:
        self.name = name
        self.client = client
        self.bindings = bindings
        self.batch_size = batch_size
        self.queues: tuple[QueueDefinition | str, ...] = tuple(binding.queue for binding in bindings)
        every_fifo = all(binding.is_fifo for binding in bindings)
        self.capabilities = TransportCapabilities(
            durable_delivery=True, message_grouping=every_fifo, native_delay=False, ordered_delivery=every_fifo
        )
        self._by_queue = {binding.queue_name: binding for binding in bindings}
        self._urls: dict[str, str] = {
            binding.queue_name: binding.source
            for binding in bindings
            if binding.source_type is SqsQueueSourceType.QUEUE_URL
        }

    def __repr__(self) -> str:
        return f"SqsTransport(name={self.name!r}, queues={[binding.queue_name for binding in self.bindings]!r})"

    def binding(self, queue: str) -> SqsQueueBinding:
        """The binding of the Runlane queue named ``queue``; ``configuration_invalid`` when unbound."""
        found = self._by_queue.get(queue)
        if found is None:
            raise invalid(
                f"Transport {self.name!r} has no SQS binding for queue {queue!r}; "
                f"it binds {', '.join(repr(name) for name in self._by_queue)}.",
                queue=queue,
            )
        return found

    async def queue_url(self, queue: str, *, detached: bool = False) -> str:
        """The SQS queue URL of the Runlane queue named ``queue`` (a ``queue_name`` binding is resolved
        with ``GetQueueUrl`` once, then cached). ``detached`` is ``call_sqs``'s: for a caller that may
        stop waiting."""
        known = self._urls.get(queue)
        if known is not None:
            return known
        binding = self.binding(queue)
        params: dict[str, Any] = {"QueueName": binding.source}
        if binding.queue_owner_aws_account_id is not None:
            params["QueueOwnerAWSAccountId"] = binding.queue_owner_aws_account_id
        try:
            response = await call_sqs(self.client, "get_queue_url", detached=detached, **params)
        except Exception as error:
            raise classify_provider_error(
                error, operation=f"GetQueueUrl({binding.source})", refused=ErrorCode.CONFIGURATION_INVALID
            ) from None
        url = response.get("QueueUrl") if isinstance(response, dict) else None
        if not isinstance(url, str) or not url:
            raise invalid(
                f"SQS GetQueueUrl({binding.source}) answered without a QueueUrl; check the queue name.", queue=queue
            )
        self._urls[queue] = url
        return url

    async def start(self) -> None:
        """Nothing to probe: queue names resolve on first publish, and storage is the startup check."""

    async def close(self) -> None:
        """The client belongs to the caller; nothing to release here."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        """Publish every attempt of ``command``; ``outcomes[i]`` answers ``command.attempts[i]``."""
        checked = validate_publish_wakeups_command(command)
        attempts = checked.attempts
        outcomes: list[WakeupPublishOutcome | None] = [None] * len(attempts)
        grouped: dict[str, list[int]] = {}
        for index, attempt in enumerate(attempts):
            if attempt.message.queue in self._by_queue:
                grouped.setdefault(attempt.message.queue, []).append(index)
            else:
                outcomes[index] = self._unbound(attempt)
        chunks: list[_Chunk] = []
        failures: list[RunlaneError] = []
        for queue, indexes in grouped.items():
            try:
                url = await self.queue_url(queue)
            except RunlaneError as error:
                if error.code is ErrorCode.CONFIGURATION_INVALID:
                    raise  # a name that does not resolve: the whole call is refused, nothing is sent
                failures.append(self._failed(error, indexes, outcomes))  # an outage: the other queues still go out
                continue
            binding = self._by_queue[queue]
            for start in range(0, len(indexes), self.batch_size):
                chunks.append(_Chunk(url, binding, tuple(indexes[start : start + self.batch_size])))
        answers = await asyncio.gather(
            *(self._send(chunk, attempts) for chunk in chunks), return_exceptions=True
        )
        for chunk, answer in zip(chunks, answers):
            if isinstance(answer, _CallFailed):
                failures.append(self._failed(answer, chunk.indexes, outcomes))
            elif isinstance(answer, BaseException):
                raise answer
            else:
                for index, outcome in answer.items():
                    outcomes[index] = outcome
        if failures and all(outcome is not None and outcome.failure is not None for outcome in outcomes):
            raise failures[0]  # nothing got through: an operation-level failure, as for a single call
        assert all(outcome is not None for outcome in outcomes)
        return PublishWakeupsResult(outcome for outcome in outcomes if outcome is not None)

    @staticmethod
    def _failed(
        failure: RunlaneError, indexes: Sequence[int], outcomes: list[WakeupPublishOutcome | None]
    ) -> RunlaneError:
        record = OutboxFailureRecord(
            code=failure.code,
            message=failure.message,
            retryable=failure.retryable,
            failed_at=datetime.now(UTC),
            meta=failure.meta,
        )
        for index in indexes:
            outcomes[index] = WakeupPublishOutcome(type=WakeupPublishOutcomeType.FAILED, failure=record)
        return failure

    def _unbound(self, attempt: WakeupPublishAttempt) -> WakeupPublishOutcome:
        # Possible only for rows written before the queue's binding was removed; retrying cannot help.
        return WakeupPublishOutcome(
            type=WakeupPublishOutcomeType.FAILED,
            failure=OutboxFailureRecord(
                code=ErrorCode.TRANSPORT_PUBLISH_FAILED,
                message=f"Transport {self.name!r} has no SQS binding for queue {attempt.message.queue!r}.",
                retryable=False,
                failed_at=datetime.now(UTC),
                meta={"queue": attempt.message.queue, "transport": self.name},
            ),
        )

    def _entry(self, index: int, attempt: WakeupPublishAttempt, binding: SqsQueueBinding) -> dict[str, Any]:
        entry: dict[str, Any] = {"Id": str(index), "MessageBody": encode_sqs_wakeup_body(attempt.message)}
        fifo = binding.fifo
        if fifo is not None:
            run_group = fifo.message_group is SqsFifoMessageGroup.RUN
            entry["MessageGroupId"] = message_group_id(attempt.message.run_id if run_group else attempt.message.queue)
            if fifo.deduplication is SqsFifoDeduplication.OUTBOX:
                entry["MessageDeduplicationId"] = deduplication_id(attempt.outbox_message_id)
        return entry

    async def _send(self, chunk: _Chunk, attempts: tuple[WakeupPublishAttempt, ...]) -> dict[int, WakeupPublishOutcome]:
        entries = [self._entry(index, attempts[index], chunk.binding) for index in chunk.indexes]
        try:
            response = await call_sqs(self.client, "send_message_batch", QueueUrl=chunk.queue_url, Entries=entries)
        except Exception as error:
            failure = classify_provider_error(error, operation="SendMessageBatch", queue_url=chunk.queue_url)
            raise _CallFailed(_publish_failure(failure)) from None
        return self._outcomes(chunk, response)

    def _outcomes(self, chunk: _Chunk, response: Any) -> dict[int, WakeupPublishOutcome]:
        expected = {str(index): index for index in chunk.indexes}
        answered: dict[int, WakeupPublishOutcome] = {}
        now = datetime.now(UTC)
        request_id = None
        if isinstance(response, dict) and isinstance(response.get("ResponseMetadata"), dict):
            request_id = response["ResponseMetadata"].get("RequestId")
        successful = response.get("Successful") or [] if isinstance(response, dict) else None
        failed = response.get("Failed") or [] if isinstance(response, dict) else None
        if not isinstance(successful, list) or not isinstance(failed, list):
            raise self._untrustworthy(chunk, "it is not a SendMessageBatch result")
        for entry, accepted in [(entry, True) for entry in successful] + [(entry, False) for entry in failed]:
            entry_id = entry.get("Id") if isinstance(entry, dict) else None
            index = expected.get(entry_id) if isinstance(entry_id, str) else None
            if index is None:
                raise self._untrustworthy(chunk, f"it answers entry {entry_id!r}, which was not sent")
            if index in answered:
                raise self._untrustworthy(chunk, f"it answers entry {entry_id!r} twice")
            if accepted:
                message_id = entry.get("MessageId")
                answered[index] = WakeupPublishOutcome(
                    type=WakeupPublishOutcomeType.PUBLISHED,
                    published_at=now,
                    provider_message_id=message_id if isinstance(message_id, str) and message_id else None,
                )
                continue
            code = entry.get("Code")
            sender_fault = entry.get("SenderFault") is True
            meta = {
                "provider_code": code if isinstance(code, str) else None,
                "sender_fault": sender_fault,
                "request_id": request_id if isinstance(request_id, str) else None,
                "queue_url": chunk.queue_url,
                "queue": chunk.binding.queue_name,
            }
            answered[index] = WakeupPublishOutcome(
                type=WakeupPublishOutcomeType.FAILED,
                failure=OutboxFailureRecord(
                    code=ErrorCode.TRANSPORT_PUBLISH_FAILED,
                    message=f"SQS did not accept the wakeup ({code if isinstance(code, str) else 'no code'}).",
                    retryable=not sender_fault,
                    failed_at=now,
                    meta={key: value for key, value in meta.items() if value is not None},
                ),
            )
        missing = [entry_id for entry_id, index in expected.items() if index not in answered]
        if missing:
            raise self._untrustworthy(chunk, f"it does not answer entry {missing[0]!r}")
        return answered

    def _untrustworthy(self, chunk: _Chunk, reason: str) -> RunlaneError:
        return RunlaneError(
            ErrorCode.TRANSPORT_PUBLISH_FAILED,
            f"SQS answered SendMessageBatch on {chunk.queue_url} in a way that cannot be matched to the wakeups "
            f"sent ({reason}); every wakeup of this call will be published again.",
            retryable=True,
            meta={"queue_url": chunk.queue_url},
        )


def sqs_transport(
    *,
    client: Any,
    queues: Sequence[SqsQueueBinding],
    batch_size: int = SQS_MAX_BATCH_SIZE,
    name: str = "sqs",
) -> SqsTransport:
    """A transport publishing wakeups through ``client`` (``boto3.client("sqs")``) to the SQS queues
    bound by ``queues`` (``sqs_queue(...)`` bindings, at least one, one per Runlane queue).

    ``batch_size`` (1-10) is the ``SendMessageBatch`` chunk size.
    """
    if not isinstance(name, str) or not name:
        raise invalid(f"A transport name must be a non-empty string, got {name!r}.", field="name")
    check_client(client, ("send_message_batch", "get_queue_url"), f"sqs_transport({name!r})")
    if isinstance(queues, (str, bytes, SqsQueueBinding)) or not isinstance(queues, Sequence) or not queues:
        raise invalid(
            "queues must be a non-empty list of sqs_queue(...) bindings, one per Runlane queue.", field="queues"
        )
    seen: set[str] = set()
    for binding in queues:
        if not isinstance(binding, SqsQueueBinding):
            raise invalid(f"Every entry of queues must come from sqs_queue(...), got {binding!r}.", field="queues")
        if binding.queue_name in seen:
            raise invalid(
                f"Queue {binding.queue_name!r} is bound twice; bind each Runlane queue to one SQS queue.",
                field="queues",
                queue=binding.queue_name,
            )
        seen.add(binding.queue_name)
    size = check_count(batch_size, "batch_size", 1, SQS_MAX_BATCH_SIZE)
    return SqsTransport(client=client, bindings=tuple(queues), batch_size=size, name=name)
