"""``TransportConformance``: the transport contract as a pytest base class a transport package subclasses.

The suite proves the publish boundary through the adapter's public surface only: its shape (a
non-empty ``name``, an async ``publish_wakeups(command)``, optional ``start()`` / ``close()``), that a
malformed publish command is rejected as a whole with ``adapter_contract_violation`` and nothing is
published, and that every accepted command is answered with exactly one well-formed outcome per
attempt, by index (checked with ``parse_publish_wakeups_result``, the same check core applies).

Usage::

    class TestMyTransport(TransportConformance):
        wakeup_queues = ("emails", "reports")  # queues the transport under test is bound to

        @pytest.fixture
        def transport(self):
            return my_transport()  # fresh and not yet started, one per test

Three optional hooks let the suite see more of a transport that can show it; each defaults to
"not available" and the tests that need it are skipped. The suite calls them while the transport is
started:

- ``published_messages(transport)``: the wakeups the provider accepted so far, so the suite can check
  that published outcomes match what was really published and that rejected commands published nothing;
- ``fail_next_attempts(transport, count)``: make the next ``count`` attempts fail at the provider, so
  the suite can check failed outcomes and that outcomes follow attempt order;
- ``fail_next_operation(transport)``: make the next publish call fail as a whole (an outage).

Test methods are plain synchronous functions. Each runs its body with ``asyncio.run`` under a hard
timeout, calling the transport's ``start()`` before and ``close()`` after when it has them, so no
async pytest plugin is needed. External resources (a queue per test, say) belong in the fixture:
create them before returning the transport and remove them after a ``yield``.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ..core.lanes import LaneDelivery, TransportAdapter
from ..core.transport import (
    PublishWakeupsCommand,
    WakeupPublishAttempt,
    parse_publish_wakeups_result,
)
from ..errors import ErrorCode, RunlaneError
from ..models import DeliveryMessage, Environment, WakeupPublishOutcome
from ..vocabulary import LaneDeliveryMode, WakeupPublishOutcomeType

__all__ = ["TransportConformance"]

_CONTRACT = ErrorCode.ADAPTER_CONTRACT_VIOLATION
_OUTAGE_CODES = (ErrorCode.TRANSPORT_UNAVAILABLE, ErrorCode.TRANSPORT_PUBLISH_FAILED)
_PUBLISHED, _FAILED = WakeupPublishOutcomeType.PUBLISHED, WakeupPublishOutcomeType.FAILED
_T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


# ---------------------------------------------------------------------------------------------
# Commands


class _Scope:
    """Fresh environments, run ids and outbox ids for one test, so a shared provider sees no collisions."""

    def __init__(self, queues: Sequence[str]) -> None:
        if not queues:
            raise AssertionError("wakeup_queues must name at least one queue the transport is bound to")
        self.token = uuid.uuid4().hex[:16]
        self.queues = tuple(queues)
        self.environments = (
            Environment(name=f"conformance-{self.token}"),
            Environment(name=f"conformance-{self.token}-other"),
        )
        self._messages = 0
        self._attempts = 0

    def message(self) -> DeliveryMessage:
        """A new wakeup; consecutive ones alternate environments and cycle through the queues."""
        serial = self._messages
        self._messages += 1
        trace = {"traceparent": f"00-{self.token}{self.token}-{serial + 1:016x}-01"}
        return DeliveryMessage(
            environment=self.environments[serial % 2],
            run_id=f"run_{self.token}_{serial}",
            queue=self.queues[serial % len(self.queues)],
            requested_at=_T0 + timedelta(seconds=serial),
            # Every third wakeup carries trace context, the only optional field a wakeup has.
            trace_carrier=trace if serial % 3 == 0 else None,
        )

    def attempt(self, message: DeliveryMessage | None = None) -> WakeupPublishAttempt:
        self._attempts += 1
        return WakeupPublishAttempt(
            outbox_message_id=f"outbox_{self.token}_{self._attempts}",
            claim_token=f"claim_{self.token}_{self._attempts}",
            message=message or self.message(),
        )

    def command(self, size: int) -> PublishWakeupsCommand:
        return PublishWakeupsCommand(self.attempt() for _ in range(size))


def _forge(cls: type, **fields: Any) -> Any:
    """A value of ``cls`` built around its constructor, the way a buggy caller could hand one over."""
    value: Any = object.__new__(cls)
    for name, field in fields.items():
        object.__setattr__(value, name, field)
    return value


def _malformed_commands(scope: _Scope) -> list[tuple[str, object]]:
    """Commands a transport must reject; the ones with attempts start with valid attempts."""
    valid = [scope.attempt(), scope.attempt()]
    good = scope.message()

    def forged(*extra: object) -> PublishWakeupsCommand:
        return _forge(PublishWakeupsCommand, attempts=(*valid, *extra))

    def attempt(**changes: Any) -> WakeupPublishAttempt:
        fields = {"outbox_message_id": f"outbox_{scope.token}_bad", "claim_token": "claim", "message": good, **changes}
        return _forge(WakeupPublishAttempt, **fields)

    def message(**changes: Any) -> DeliveryMessage:
        forged = DeliveryMessage.model_construct(**dict(good))
        forged.__dict__.update(changes)  # model_construct would drop an unknown field
        return forged

    return [
        ("None instead of a command", None),
        ("a list of attempts instead of a command", list(valid)),
        ("a dict shaped like a command", {"attempts": list(valid)}),
        ("a bare attempt instead of a command", valid[0]),
        ("a command whose attempts are a list", _forge(PublishWakeupsCommand, attempts=list(valid))),
        ("a command without attempts", _forge(PublishWakeupsCommand)),
        ("an attempt that is a dict", forged({"outbox_message_id": "x", "claim_token": "y", "message": good})),
        ("an attempt that is a bare DeliveryMessage", forged(good)),
        ("an empty outbox_message_id", forged(attempt(outbox_message_id=""))),
        ("a non-string outbox_message_id", forged(attempt(outbox_message_id=42))),
        ("an empty claim_token", forged(attempt(claim_token=""))),
        ("a missing claim_token", forged(_forge(WakeupPublishAttempt, outbox_message_id="x", message=good))),
        ("a message that is a dict", forged(attempt(message=good.to_json()))),
        ("a message without a run id", forged(attempt(message=message(run_id="")))),
        ("a message with a ':' in its queue", forged(attempt(message=message(queue="a:b")))),
        ("a message with a naive requested_at", forged(attempt(message=message(requested_at=datetime(2026, 1, 1))))),
        ("a message with an unknown field", forged(attempt(message=message(payload={"secret": 1})))),
        ("a repeated outbox_message_id", forged(attempt(outbox_message_id=valid[0].outbox_message_id))),
    ]


# ---------------------------------------------------------------------------------------------
# Checks


async def _call_hook(transport: object, hook: str) -> None:
    method = getattr(transport, hook, None)
    if method is None:
        return
    result = method()
    if inspect.isawaitable(result):
        await result


async def _publish(transport: Any, command: object) -> object:
    call = transport.publish_wakeups(command)
    assert inspect.isawaitable(call), (
        f"publish_wakeups() must be async (return an awaitable), got {type(call).__name__}"
    )
    return await call


def _check_result(command: PublishWakeupsCommand, result: object, what: str) -> tuple[WakeupPublishOutcome, ...]:
    """Core's own result check, reported as a test failure; then the per-outcome details."""
    try:
        parsed = parse_publish_wakeups_result(command, result)
    except RunlaneError as error:
        raise AssertionError(f"{what}: the result breaks the publish contract: {error.message}") from None
    for index, outcome in enumerate(parsed.outcomes):
        if outcome.type is _PUBLISHED:
            assert outcome.published_at is not None and outcome.published_at.tzinfo is not None, (
                f"{what}: published outcome {index} needs an aware published_at"
            )
        else:
            failure = outcome.failure
            assert failure is not None, f"{what}: failed outcome {index} needs a failure record"
            assert isinstance(failure.code, ErrorCode), f"{what}: failed outcome {index}: code must be an ErrorCode"
            assert isinstance(failure.retryable, bool), f"{what}: failed outcome {index}: retryable must be a bool"
            assert failure.failed_at.tzinfo is not None, f"{what}: failed outcome {index} needs an aware failed_at"
    return parsed.outcomes


async def _outcomes(transport: Any, command: PublishWakeupsCommand, what: str) -> tuple[WakeupPublishOutcome, ...]:
    """Publish a valid ``command`` and check the result; raising for it is a failure of the test."""
    try:
        result = await _publish(transport, command)
    except AssertionError:
        raise
    except Exception as error:  # noqa: BLE001 - any exception is reported as the failure
        raise AssertionError(
            f"{what}: publish_wakeups() raised {error!r}; a valid command is answered with one outcome per "
            "attempt, and an attempt the provider rejected is a failed outcome, not an exception"
        ) from error
    return _check_result(command, result, what)


async def _expect_rejected(transport: Any, command: object, what: str) -> None:
    """``command`` is malformed: publish_wakeups() must raise RunlaneError(adapter_contract_violation)."""
    try:
        result = await _publish(transport, command)
    except RunlaneError as error:
        assert error.code is _CONTRACT, (
            f"{what}: expected adapter_contract_violation, got {error.code.value!r} ({error.message})"
        )
    except AssertionError:
        raise
    except Exception as error:  # noqa: BLE001 - any other exception is reported as the failure
        raise AssertionError(f"{what}: expected RunlaneError(adapter_contract_violation), got {error!r}") from error
    else:
        raise AssertionError(f"{what}: the malformed command was accepted (returned {result!r})")


def _types(outcomes: Sequence[WakeupPublishOutcome]) -> list[str]:
    return [outcome.type.value for outcome in outcomes]


def _wakeup_identity(message: DeliveryMessage) -> tuple[str, str, str]:
    return (message.environment.name, message.run_id, message.queue)


class TransportConformance:
    """Subclass as ``Test...`` and override the ``transport`` fixture (a fresh, unstarted transport per test).

    Set ``wakeup_queues`` to queue names the transport can publish to, and override the optional
    hooks (``published_messages``, ``fail_next_attempts``, ``fail_next_operation``) when the
    transport under test can support them.
    """

    #: Queue names the wakeups in this suite are addressed to (the transport must be bound to them).
    wakeup_queues: tuple[str, ...] = ("conformance.default", "conformance.other")
    #: Attempts in the larger commands; keep it within what one publish call of the transport accepts.
    attempts_per_command: int = 5
    #: Hard limit for one test's body; nothing in the suite may hang.
    timeout_seconds: float = 60.0

    @pytest.fixture
    def transport(self) -> TransportAdapter:
        pytest.fail("Override the `transport` fixture: return a fresh, unstarted TransportAdapter for every test.")

    # -- optional hooks -------------------------------------------------------------------------

    def published_messages(self, transport: Any) -> Sequence[DeliveryMessage] | None:
        """Every wakeup the provider accepted so far, or ``None`` when the transport cannot show them."""
        return None

    def fail_next_attempts(self, transport: Any, count: int) -> bool:
        """Make the provider fail the next ``count`` attempts (in attempt order); ``False`` if unsupported."""
        return False

    def fail_next_operation(self, transport: Any) -> bool:
        """Make the next publish call fail as a whole, before any outcome exists; ``False`` if unsupported."""
        return False

    # -- harness ---------------------------------------------------------------------------------

    def run_async(self, body: Callable[[], Awaitable[Any]], transport: object) -> None:
        """Run ``body`` in a fresh event loop between the transport's ``start()`` and ``close()``."""

        async def main() -> None:
            await _call_hook(transport, "start")
            try:
                await body()
            finally:
                await _call_hook(transport, "close")

        try:
            asyncio.run(asyncio.wait_for(main(), self.timeout_seconds))
        except TimeoutError:
            raise AssertionError(
                f"the test did not finish within {self.timeout_seconds}s: a publish call blocked"
            ) from None

    def _scope(self) -> _Scope:
        return _Scope(self.wakeup_queues)

    def _published(self, transport: Any) -> list[DeliveryMessage] | None:
        seen = self.published_messages(transport)
        return None if seen is None else list(seen)

    def _require(self, supported: bool, hook: str) -> None:
        if not supported:
            pytest.skip(f"override `{hook}` on the conformance subclass to run this test")

    async def _publish_all(
        self, transport: Any, command: PublishWakeupsCommand, what: str
    ) -> tuple[WakeupPublishOutcome, ...]:
        """Publish ``command`` on a healthy transport: every attempt must come back published."""
        outcomes = await _outcomes(transport, command, what)
        assert _types(outcomes) == [_PUBLISHED.value] * len(command.attempts), (
            f"{what}: a healthy transport publishes every attempt, got {_types(outcomes)}"
        )
        return outcomes

    # =============================================================================================
    # Shape

    def test_adapter_shape(self, transport: Any) -> None:
        """A non-empty name, an async publish_wakeups(command), and start()/close() methods when present."""
        name = getattr(transport, "name", None)
        assert isinstance(name, str) and name, f"a transport has a non-empty string name, got {name!r}"
        assert callable(getattr(transport, "publish_wakeups", None)), "a transport has publish_wakeups(command)"
        assert isinstance(transport, TransportAdapter), "the transport must satisfy the TransportAdapter protocol"
        for hook in ("start", "close"):
            value = getattr(transport, hook, None)
            assert value is None or callable(value), f"{hook} must be a method when present, got {value!r}"
        try:
            delivery = LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
        except RunlaneError as error:
            raise AssertionError(f"a transport lane rejects this transport: {error.message}") from None
        assert delivery.transport is transport, "a transport lane keeps the transport instance"
        scope = self._scope()

        async def body() -> None:
            command = scope.command(1)
            await self._publish_all(transport, command, "one attempt between start() and close()")

        self.run_async(body, transport)

    # =============================================================================================
    # Outcomes

    def test_returns_one_valid_outcome_per_attempt(self, transport: Any) -> None:
        """Exactly one outcome per attempt, each published with an aware published_at."""
        scope = self._scope()

        async def body() -> None:
            before = self._published(transport)
            command = scope.command(self.attempts_per_command)
            snapshot = [attempt.message.model_dump() for attempt in command.attempts]
            outcomes = await self._publish_all(transport, command, f"a command of {len(command.attempts)} attempts")
            for index, outcome in enumerate(outcomes):
                assert outcome.provider_message_id is None or isinstance(outcome.provider_message_id, str), (
                    f"outcome {index}: provider_message_id is an optional string"
                )
            assert [attempt.message.model_dump() for attempt in command.attempts] == snapshot, (
                "publish_wakeups() must not modify the command it was given"
            )
            after = self._published(transport)
            if before is not None and after is not None:
                new = after[len(before) :]
                assert sorted(map(_wakeup_identity, new)) == sorted(
                    _wakeup_identity(attempt.message) for attempt in command.attempts
                ), "the provider must receive exactly the command's wakeups, once each"
                by_identity = {_wakeup_identity(message): message for message in new}
                for attempt in command.attempts:
                    assert by_identity[_wakeup_identity(attempt.message)] == attempt.message, (
                        "a published wakeup carries the attempt's message unchanged (environment, run id, queue, "
                        "requested_at, trace_carrier)"
                    )

        self.run_async(body, transport)

    def test_single_attempt_command(self, transport: Any) -> None:
        """The smallest command, one attempt, gets exactly one outcome."""
        scope = self._scope()

        async def body() -> None:
            await self._publish_all(transport, scope.command(1), "a command of one attempt")

        self.run_async(body, transport)

    def test_republishing_an_outbox_message_is_accepted(self, transport: Any) -> None:
        """Duplicate wakeups are safe: the same row under a new claim, and the same run twice, both publish."""
        scope = self._scope()

        async def body() -> None:
            first = scope.command(2)
            await self._publish_all(transport, first, "the first publish")
            again = PublishWakeupsCommand(
                [
                    WakeupPublishAttempt(attempt.outbox_message_id, f"{attempt.claim_token}-reclaimed", attempt.message)
                    for attempt in first.attempts
                ]
            )
            await self._publish_all(transport, again, "the same outbox rows under a new claim")
            message = first.attempts[0].message
            twice = PublishWakeupsCommand([scope.attempt(message), scope.attempt(message)])
            await self._publish_all(transport, twice, "two outbox rows carrying the same wakeup")

        self.run_async(body, transport)

    def test_concurrent_publishes_get_their_own_outcomes(self, transport: Any) -> None:
        """Overlapping calls each get exactly the outcomes of their own command."""
        scope = self._scope()

        async def body() -> None:
            sizes = [1, self.attempts_per_command, 2, 3]
            commands = [scope.command(size) for size in sizes]
            answers = await asyncio.gather(
                *(
                    _outcomes(transport, command, f"a concurrent command of {size} attempts")
                    for size, command in zip(sizes, commands, strict=True)
                )
            )
            for size, outcomes in zip(sizes, answers, strict=True):
                assert _types(outcomes) == [_PUBLISHED.value] * size, (
                    f"a healthy transport publishes every attempt, got {_types(outcomes)}"
                )

        self.run_async(body, transport)

    def test_failed_outcomes_carry_a_failure_record(self, transport: Any) -> None:
        """A provider-rejected attempt is a failed outcome with an ErrorCode failure record, not a raise."""
        scope = self._scope()

        async def body() -> None:
            self._require(self.fail_next_attempts(transport, 1), "fail_next_attempts")
            before = self._published(transport)
            command = scope.command(1)
            (outcome,) = await _outcomes(transport, command, "one rejected attempt")
            assert outcome.type is _FAILED, f"the injected failure must come back failed, got {outcome.type.value!r}"
            assert outcome.published_at is None and outcome.provider_message_id is None
            assert outcome.failure is not None and isinstance(outcome.failure.code, ErrorCode)
            after = self._published(transport)
            if before is not None and after is not None:
                assert after == before, "a failed attempt is not published"

        self.run_async(body, transport)

    def test_outcomes_follow_attempt_order(self, transport: Any) -> None:
        """``outcomes[i]`` answers ``attempts[i]``: the failed attempts are exactly the ones that failed."""
        scope = self._scope()

        async def body() -> None:
            self._require(self.fail_next_attempts(transport, 2), "fail_next_attempts")
            before = self._published(transport)
            command = scope.command(4)
            outcomes = await _outcomes(transport, command, "two failed, then two published")
            assert _types(outcomes) == ["failed", "failed", "published", "published"], (
                f"the first two attempts failed at the provider; outcomes must say so by index, got {_types(outcomes)}"
            )
            after = self._published(transport)
            if before is not None and after is not None:
                assert after[len(before) :] == [attempt.message for attempt in command.attempts[2:]], (
                    "only the attempts with published outcomes reach the provider"
                )
            assert self.fail_next_attempts(transport, 3)
            first, second = scope.command(2), scope.command(3)
            outcomes = await _outcomes(transport, first, "failures spanning two calls")
            assert _types(outcomes) == ["failed", "failed"], _types(outcomes)
            outcomes = await _outcomes(transport, second, "failures spanning two calls")
            assert _types(outcomes) == ["failed", "published", "published"], _types(outcomes)

        self.run_async(body, transport)

    def test_operation_failure_raises_and_publishes_nothing(self, transport: Any) -> None:
        """An outage raises transport_unavailable / transport_publish_failed; the next call works again."""
        scope = self._scope()

        async def body() -> None:
            self._require(self.fail_next_operation(transport), "fail_next_operation")
            before = self._published(transport)
            command = scope.command(3)
            try:
                result = await _publish(transport, command)
            except RunlaneError as error:
                assert error.code in _OUTAGE_CODES, (
                    "an operation-level failure is transport_unavailable or transport_publish_failed, "
                    f"got {error.code.value!r}"
                )
            except AssertionError:
                raise
            except Exception as error:  # noqa: BLE001 - any other exception is reported as the failure
                raise AssertionError(
                    f"an operation-level failure raises RunlaneError(transport_unavailable), got {error!r}"
                ) from error
            else:
                raise AssertionError(f"an operation-level failure must raise, got {result!r}")
            after = self._published(transport)
            if before is not None and after is not None:
                assert after == before, "an operation-level failure publishes nothing"
            await self._publish_all(transport, scope.command(2), "the call after the outage")

        self.run_async(body, transport)

    # =============================================================================================
    # Malformed commands

    def test_malformed_publish_commands_are_rejected(self, transport: Any) -> None:
        """Each malformed command raises adapter_contract_violation and publishes nothing, not even a prefix."""
        scope = self._scope()

        async def body() -> None:
            before = self._published(transport)
            for what, command in _malformed_commands(scope):
                await _expect_rejected(transport, command, what)
                after = self._published(transport)
                if before is not None and after is not None:
                    assert after == before, (
                        f"{what}: a rejected command must publish nothing, not even its valid prefix"
                    )
            await self._publish_all(transport, scope.command(2), "a valid command after the rejected ones")

        self.run_async(body, transport)

    def test_empty_command_is_rejected(self, transport: Any) -> None:
        """A command with no attempts is malformed: it has no outcome to report and nothing was claimed."""
        empty = _forge(PublishWakeupsCommand, attempts=())

        async def body() -> None:
            await _expect_rejected(transport, empty, "a command with no attempts")

        self.run_async(body, transport)
