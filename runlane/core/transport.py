"""The wakeup publish contract: the command core hands a transport and the indexed result it gets back.

Core claims outbox rows and passes them to ``TransportAdapter.publish_wakeups()`` as one
``PublishWakeupsCommand``: an ordered, non-empty tuple of ``WakeupPublishAttempt`` values, each keyed
by its outbox message id and claim token. A transport answers with a ``PublishWakeupsResult`` whose
``outcomes[index]`` is the outcome of ``command.attempts[index]``: ids are never echoed, and successes
and failures are never split into parallel lists. A transport that cannot produce a trustworthy
outcome for every attempt raises instead (``transport_unavailable`` or ``transport_publish_failed``),
and core records that one failure against every attempt of the command.

``validate_publish_wakeups_command()`` is what an adapter (or an adapter test) calls to validate a
command it received; ``parse_publish_wakeups_result()`` is what core calls on what an adapter
returned. Both raise ``RunlaneError(adapter_contract_violation)``. They re-check every field, so a
value built around the constructors (``object.__new__``, ``model_construct``) is caught too.

This module is contract-only: it imports Runlane's errors and models, never the runtime, storage or
a provider, so a transport package can depend on it alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ErrorCode, RunlaneError
from ..models import DeliveryMessage, WakeupPublishOutcome
from ..vocabulary import WakeupPublishOutcomeType

__all__ = [
    "PublishWakeupsCommand",
    "PublishWakeupsResult",
    "WakeupPublishAttempt",
    "parse_publish_wakeups_result",
    "validate_publish_wakeups_command",
]

_Model = TypeVar("_Model", bound=BaseModel)


def _contract(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.ADAPTER_CONTRACT_VIOLATION, message, meta=meta)


def _non_empty_string(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _contract(f"{what} must be a non-empty string, got {value!r}.")
    return value


def _as_tuple(values: object, what: str) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise _contract(f"{what} must be a sequence, got {type(values).__name__}.")
    return tuple(values)


def _plain(value: Any) -> Any:
    # A model's fields as plain data, nested models included, so the model class re-validates all of
    # them (pydantic does not re-validate an instance it is handed).
    if isinstance(value, BaseModel):
        return {name: _plain(field) for name, field in value.__dict__.items()}
    return value


def _revalidate(model: type[_Model], value: object, what: str, **meta: Any) -> _Model:
    if not isinstance(value, model):
        raise _contract(f"{what} must be a {model.__name__}, got {type(value).__name__}.", **meta)
    try:
        return model.model_validate(_plain(value))
    except ValidationError as error:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in error.errors())
        raise _contract(f"{what} is not a valid {model.__name__}: {details}.", **meta) from None


# ---------------------------------------------------------------------------------------------
# Command


@dataclass(frozen=True, slots=True)
class WakeupPublishAttempt:
    """One claimed outbox row to publish: its id, the claim token core holds, and the wakeup itself."""

    outbox_message_id: str
    claim_token: str
    message: DeliveryMessage

    def __init__(self, outbox_message_id: str, claim_token: str, message: DeliveryMessage) -> None:
        object.__setattr__(self, "outbox_message_id", _non_empty_string(outbox_message_id, "outbox_message_id"))
        object.__setattr__(self, "claim_token", _non_empty_string(claim_token, "claim_token"))
        if not isinstance(message, DeliveryMessage):
            raise _contract(f"A publish attempt carries a DeliveryMessage, got {type(message).__name__}.")
        object.__setattr__(self, "message", message)


@dataclass(frozen=True, slots=True)
class PublishWakeupsCommand:
    """The claimed attempts of one publish call, in order; at least one, each outbox message at most once.

    An empty command is rejected: it has no outcome to report, and core only publishes rows it claimed.
    """

    attempts: tuple[WakeupPublishAttempt, ...]

    def __init__(self, attempts: Iterable[WakeupPublishAttempt]) -> None:
        checked = _as_tuple(attempts, "PublishWakeupsCommand.attempts")
        if not checked:
            raise _contract("A publish command needs at least one attempt; do not publish an empty command.")
        seen: set[str] = set()
        for index, attempt in enumerate(checked):
            if not isinstance(attempt, WakeupPublishAttempt):
                raise _contract(
                    f"Publish attempt {index} must be a WakeupPublishAttempt, got {type(attempt).__name__}.",
                    index=index,
                )
            if attempt.outbox_message_id in seen:
                raise _contract(
                    f"Publish attempt {index} repeats outbox message {attempt.outbox_message_id!r}; "
                    "each claimed row appears once per command.",
                    index=index,
                )
            seen.add(attempt.outbox_message_id)
        object.__setattr__(self, "attempts", checked)


def _revalidate_attempt(attempt: object, index: int) -> WakeupPublishAttempt:
    if not isinstance(attempt, WakeupPublishAttempt):
        raise _contract(
            f"Publish attempt {index} must be a WakeupPublishAttempt, got {type(attempt).__name__}.", index=index
        )
    try:
        return WakeupPublishAttempt(
            getattr(attempt, "outbox_message_id", None),  # type: ignore[arg-type]
            getattr(attempt, "claim_token", None),  # type: ignore[arg-type]
            _revalidate(DeliveryMessage, getattr(attempt, "message", None), "its message"),
        )
    except RunlaneError as error:
        raise _contract(f"Publish attempt {index}: {error.message}", index=index) from None


def validate_publish_wakeups_command(command: object) -> PublishWakeupsCommand:
    """Check every field of ``command`` and return a fresh copy; raise ``adapter_contract_violation``.

    Call it before touching the provider, so a malformed command is rejected as a whole and nothing
    is published. The copy shares no mutable state (trace carriers) with the caller's command.
    """
    if not isinstance(command, PublishWakeupsCommand):
        raise _contract(f"publish_wakeups() takes a PublishWakeupsCommand, got {type(command).__name__}.")
    attempts = getattr(command, "attempts", None)
    if not isinstance(attempts, tuple):
        raise _contract(
            f"PublishWakeupsCommand.attempts must be a tuple of WakeupPublishAttempt, got {type(attempts).__name__}."
        )
    return PublishWakeupsCommand(_revalidate_attempt(attempt, index) for index, attempt in enumerate(attempts))


# ---------------------------------------------------------------------------------------------
# Result


@dataclass(frozen=True, slots=True)
class PublishWakeupsResult:
    """``outcomes[index]`` is the outcome of ``command.attempts[index]``; exactly one per attempt."""

    outcomes: tuple[WakeupPublishOutcome, ...]

    def __init__(self, outcomes: Iterable[WakeupPublishOutcome]) -> None:
        checked = _as_tuple(outcomes, "PublishWakeupsResult.outcomes")
        for index, outcome in enumerate(checked):
            if not isinstance(outcome, WakeupPublishOutcome):
                raise _contract(
                    f"Publish outcome {index} must be a WakeupPublishOutcome, got {type(outcome).__name__}.",
                    index=index,
                )
        object.__setattr__(self, "outcomes", checked)


def _check_outcome(outcome: object, index: int) -> WakeupPublishOutcome:
    checked = _revalidate(WakeupPublishOutcome, outcome, f"Publish outcome {index}", index=index)
    if checked.type is WakeupPublishOutcomeType.PUBLISHED:
        if checked.failure is not None:
            raise _contract(f"Publish outcome {index} is published but carries a failure record.", index=index)
        if checked.provider_message_id is not None and not checked.provider_message_id:
            raise _contract(f"Publish outcome {index} has an empty provider_message_id; omit it instead.", index=index)
    elif checked.published_at is not None or checked.provider_message_id is not None:
        # The model already requires the failure record of a failed outcome.
        raise _contract(
            f"Publish outcome {index} is failed but carries published_at or provider_message_id.", index=index
        )
    return checked


def parse_publish_wakeups_result(command: PublishWakeupsCommand, result: object) -> PublishWakeupsResult:
    """Check what ``publish_wakeups(command)`` returned: one well-formed outcome per attempt, by index.

    Missing, extra or malformed outcomes raise ``adapter_contract_violation`` (``meta`` has
    ``expected`` and ``received`` for a count mismatch, ``index`` for a bad outcome).
    """
    if not isinstance(result, PublishWakeupsResult):
        raise _contract(f"publish_wakeups() must return a PublishWakeupsResult, got {type(result).__name__}.")
    outcomes = getattr(result, "outcomes", None)
    if not isinstance(outcomes, tuple):
        raise _contract(
            f"PublishWakeupsResult.outcomes must be a tuple of WakeupPublishOutcome, got {type(outcomes).__name__}."
        )
    expected = len(command.attempts)
    if len(outcomes) != expected:
        raise _contract(
            f"publish_wakeups() returned {len(outcomes)} outcomes for {expected} attempts; "
            "return exactly one outcome per attempt, in attempt order, or raise for an operation-level failure.",
            expected=expected,
            received=len(outcomes),
        )
    return PublishWakeupsResult(_check_outcome(outcome, index) for index, outcome in enumerate(outcomes))
