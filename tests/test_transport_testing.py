"""The publish contract, ``RecordingTransport``, and ``TransportConformance`` (which must be able to fail).

``RecordingTransport`` runs the whole conformance suite with every optional hook on, and a minimal
transport without lifecycle hooks or fault injection runs it too. Each broken transport below gets
one part of the publish contract wrong the way a real adapter might, and the conformance tests that
guard that part must fail against it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from runlane_local import local_storage_driver

from runlane.core.lanes import LaneDelivery, create_lane
from runlane.core.transport import (
    PublishWakeupsCommand,
    PublishWakeupsResult,
    WakeupPublishAttempt,
    parse_publish_wakeups_result,
    validate_publish_wakeups_command,
)
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import DeliveryMessage, Environment, OutboxFailureRecord, WakeupPublishOutcome
from runlane.testing import ControlledClock, RecordingTransport, TransportConformance
from runlane.vocabulary import LaneDeliveryMode, WakeupPublishOutcomeType

PUBLISHED, FAILED = WakeupPublishOutcomeType.PUBLISHED, WakeupPublishOutcomeType.FAILED
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def message(run_id: str = "run_1", *, queue: str = "emails", trace: dict[str, str] | None = None) -> DeliveryMessage:
    return DeliveryMessage(
        environment=Environment(name="test"), run_id=run_id, queue=queue, requested_at=T0, trace_carrier=trace
    )


def attempt(index: int, wakeup: DeliveryMessage | None = None) -> WakeupPublishAttempt:
    return WakeupPublishAttempt(f"outbox_{index}", f"claim_{index}", wakeup or message(f"run_{index}"))


def command(size: int) -> PublishWakeupsCommand:
    return PublishWakeupsCommand(attempt(index) for index in range(size))


def forge(cls: type, **fields: Any) -> Any:
    value = object.__new__(cls)
    for name, field in fields.items():
        object.__setattr__(value, name, field)
    return value


def published_outcome(at: datetime = T0) -> WakeupPublishOutcome:
    return WakeupPublishOutcome(type=PUBLISHED, published_at=at)


def failed_outcome() -> WakeupPublishOutcome:
    failure = OutboxFailureRecord(
        code=ErrorCode.TRANSPORT_PUBLISH_FAILED, message="rejected", retryable=True, failed_at=T0
    )
    return WakeupPublishOutcome(type=FAILED, failure=failure)


def expect_error(code: ErrorCode, call: Callable[[], Any]) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        result = call()
        if inspect.isawaitable(result):
            asyncio.run(result)  # type: ignore[arg-type]
    assert caught.value.code is code, caught.value
    return caught.value


def publish(transport: Any, published: PublishWakeupsCommand) -> PublishWakeupsResult:
    return asyncio.run(transport.publish_wakeups(published))


# ---------------------------------------------------------------------------------------------
# The publish contract


def test_a_command_keeps_its_attempts_in_order_as_a_tuple() -> None:
    attempts = [attempt(2), attempt(0), attempt(1)]
    built = PublishWakeupsCommand(attempts)
    assert built.attempts == tuple(attempts)
    with pytest.raises(AttributeError):
        built.attempts = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("what", "attempts"),
    [
        ("empty", []),
        ("not a sequence", 7),
        ("a string", "outbox_1"),
        ("a dict", {"attempts": []}),
        ("a non-attempt entry", [attempt(0), message()]),
        ("a repeated outbox id", [attempt(0), WakeupPublishAttempt("outbox_0", "claim_other", message("run_9"))]),
    ],
)
def test_a_malformed_command_cannot_be_built(what: str, attempts: Any) -> None:
    expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: PublishWakeupsCommand(attempts))


def test_attempts_on_different_claims_may_share_a_claim_token_but_not_an_outbox_id() -> None:
    shared = PublishWakeupsCommand(
        [
            WakeupPublishAttempt("outbox_1", "claim", message("run_1")),
            WakeupPublishAttempt("outbox_2", "claim", message()),
        ]
    )
    assert len(shared.attempts) == 2


@pytest.mark.parametrize(
    ("outbox_id", "claim", "wakeup"),
    [
        ("", "claim", message()),
        ("outbox", "", message()),
        (1, "claim", message()),
        ("outbox", "claim", message().to_json()),
    ],
)
def test_a_malformed_attempt_cannot_be_built(outbox_id: Any, claim: Any, wakeup: Any) -> None:
    expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: WakeupPublishAttempt(outbox_id, claim, wakeup))


def test_validating_a_command_returns_an_equal_copy_that_shares_no_trace_carrier() -> None:
    trace = {"traceparent": "00-abc-def-01"}
    original = PublishWakeupsCommand([attempt(0, message(trace=trace)), attempt(1)])
    checked = validate_publish_wakeups_command(original)
    assert checked == original
    assert checked.attempts[0].message.trace_carrier is not trace
    trace["traceparent"] = "changed"
    assert checked.attempts[0].message.trace_carrier == {"traceparent": "00-abc-def-01"}


@pytest.mark.parametrize(
    ("what", "value"),
    [
        ("None", None),
        ("a list of attempts", [attempt(0)]),
        ("attempts as a list", forge(PublishWakeupsCommand, attempts=[attempt(0)])),
        ("no attempts attribute", forge(PublishWakeupsCommand)),
        ("empty attempts", forge(PublishWakeupsCommand, attempts=())),
        (
            "a forged attempt",
            forge(PublishWakeupsCommand, attempts=(forge(WakeupPublishAttempt, outbox_message_id="x"),)),
        ),
        (
            "a forged message",
            forge(
                PublishWakeupsCommand,
                attempts=(
                    WakeupPublishAttempt(
                        "x", "y", DeliveryMessage.model_construct(**{**dict(message()), "run_id": "a:b"})
                    ),
                ),
            ),
        ),
    ],
)
def test_validating_rejects_a_command_built_around_the_constructors(what: str, value: object) -> None:
    error = expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: validate_publish_wakeups_command(value))
    assert error.retryable is False


def test_a_result_with_one_outcome_per_attempt_parses_by_index() -> None:
    sent = command(3)
    result = PublishWakeupsResult([published_outcome(), failed_outcome(), published_outcome()])
    parsed = parse_publish_wakeups_result(sent, result)
    assert [outcome.type for outcome in parsed.outcomes] == [PUBLISHED, FAILED, PUBLISHED]
    assert parsed == result


@pytest.mark.parametrize("count", [0, 1, 3])
def test_missing_or_extra_outcomes_are_a_contract_violation(count: int) -> None:
    error = expect_error(
        ErrorCode.ADAPTER_CONTRACT_VIOLATION,
        lambda: parse_publish_wakeups_result(command(2), PublishWakeupsResult([published_outcome()] * count)),
    )
    assert error.meta == {"expected": 2, "received": count}


@pytest.mark.parametrize(
    ("what", "outcome"),
    [
        ("published without published_at", WakeupPublishOutcome.model_construct(type=PUBLISHED)),
        ("failed without a failure record", WakeupPublishOutcome.model_construct(type=FAILED)),
        (
            "published with a failure record",
            published_outcome().model_copy(update={"failure": failed_outcome().failure}),
        ),
        ("failed with published_at", failed_outcome().model_copy(update={"published_at": T0})),
        ("failed with a provider id", failed_outcome().model_copy(update={"provider_message_id": "m-1"})),
        ("an empty provider id", WakeupPublishOutcome(type=PUBLISHED, published_at=T0, provider_message_id="")),
        (
            "a naive published_at",
            WakeupPublishOutcome.model_construct(type=PUBLISHED, published_at=datetime(2026, 1, 1)),
        ),
        ("an unknown outcome type", WakeupPublishOutcome.model_construct(type="queued", published_at=T0)),
        ("a dict", {"type": "published", "published_at": T0}),
    ],
)
def test_a_malformed_outcome_is_a_contract_violation(what: str, outcome: Any) -> None:
    result = forge(PublishWakeupsResult, outcomes=(published_outcome(), outcome))
    error = expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: parse_publish_wakeups_result(command(2), result))
    assert error.meta == {"index": 1}


@pytest.mark.parametrize(
    "result",
    [
        None,
        (published_outcome(),),
        {"outcomes": [published_outcome()]},
        forge(PublishWakeupsResult, outcomes=[published_outcome()]),
    ],
    ids=["None", "a tuple", "a dict", "outcomes as a list"],
)
def test_a_result_of_the_wrong_type_is_a_contract_violation(result: object) -> None:
    expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: parse_publish_wakeups_result(command(1), result))


def test_a_result_holds_only_outcomes() -> None:
    expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: PublishWakeupsResult([published_outcome(), "published"]))


# ---------------------------------------------------------------------------------------------
# RecordingTransport


def test_recording_transport_publishes_every_attempt_and_records_the_command() -> None:
    transport = RecordingTransport()
    sent = command(3)
    result = publish(transport, sent)
    assert parse_publish_wakeups_result(sent, result) == result
    assert [outcome.type for outcome in result.outcomes] == [PUBLISHED] * 3
    assert transport.published == [item.message for item in sent.attempts]
    assert transport.commands == [sent]
    assert len({outcome.provider_message_id for outcome in result.outcomes}) == 3


def test_fail_next_fails_the_next_attempts_across_calls_in_attempt_order() -> None:
    transport = RecordingTransport()
    transport.fail_next(3, retryable=False)
    first, second = command(2), PublishWakeupsCommand([attempt(5), attempt(6)])
    outcomes = publish(transport, first).outcomes
    assert [outcome.type for outcome in outcomes] == [FAILED, FAILED]
    for outcome in outcomes:
        assert outcome.failure is not None
        assert outcome.failure.code is ErrorCode.TRANSPORT_PUBLISH_FAILED
        assert outcome.failure.retryable is False
        assert outcome.published_at is None
    assert transport.published == []
    outcomes = publish(transport, second).outcomes
    assert [outcome.type for outcome in outcomes] == [FAILED, PUBLISHED]
    assert transport.published == [second.attempts[1].message]
    assert transport.pending_failures == (0, 0)


def test_fail_next_calls_queue_up_with_their_own_retryability() -> None:
    transport = RecordingTransport()
    transport.fail_next(1, retryable=False)
    transport.fail_next(1)
    assert transport.pending_failures == (2, 0)
    outcomes = publish(transport, command(3)).outcomes
    assert [outcome.failure.retryable if outcome.failure else None for outcome in outcomes] == [False, True, None]


def test_fail_operation_next_raises_for_whole_calls_and_publishes_nothing() -> None:
    transport = RecordingTransport()
    transport.fail_operation_next(2)
    for _ in range(2):
        error = expect_error(ErrorCode.TRANSPORT_UNAVAILABLE, lambda: transport.publish_wakeups(command(2)))
        assert error.retryable is True
    assert transport.published == []
    assert len(transport.commands) == 2, "a command answered with an outage was still received"
    assert [outcome.type for outcome in publish(transport, command(2)).outcomes] == [PUBLISHED, PUBLISHED]


def test_fail_operation_next_takes_a_code_and_leaves_attempt_failures_for_later() -> None:
    transport = RecordingTransport()
    transport.fail_next(1)
    transport.fail_operation_next(1, code=ErrorCode.TRANSPORT_PUBLISH_FAILED, retryable=False)
    error = expect_error(ErrorCode.TRANSPORT_PUBLISH_FAILED, lambda: transport.publish_wakeups(command(2)))
    assert error.retryable is False
    assert transport.pending_failures == (1, 0)
    assert [outcome.type for outcome in publish(transport, command(2)).outcomes] == [FAILED, PUBLISHED]


def test_a_malformed_command_is_rejected_before_failures_are_used_and_is_not_recorded() -> None:
    transport = RecordingTransport()
    transport.fail_operation_next(1)
    transport.fail_next(1)
    expect_error(ErrorCode.ADAPTER_CONTRACT_VIOLATION, lambda: transport.publish_wakeups([attempt(0)]))
    assert transport.commands == [] and transport.published == []
    assert transport.pending_failures == (1, 1)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.fail_next(-1),
        lambda t: t.fail_next(True),
        lambda t: t.fail_next(1.5),
        lambda t: t.fail_next(1, retryable="yes"),
        lambda t: t.fail_operation_next(1, code="provider_exploded"),
        lambda t: t.fail_operation_next(-2),
        lambda t: t.fail_operation_next(1, retryable=None),
    ],
)
def test_bad_failure_injection_arguments_are_rejected(call: Callable[[RecordingTransport], None]) -> None:
    transport = RecordingTransport()
    expect_error(ErrorCode.CONFIGURATION_INVALID, lambda: call(transport))
    assert transport.pending_failures == (0, 0)


def test_a_zero_count_injects_nothing() -> None:
    transport = RecordingTransport()
    transport.fail_next(0)
    transport.fail_operation_next(0)
    assert transport.pending_failures == (0, 0)
    assert [outcome.type for outcome in publish(transport, command(1)).outcomes] == [PUBLISHED]


def test_the_clock_stamps_published_and_failed_outcomes() -> None:
    clock = ControlledClock(T0)
    transport = RecordingTransport(clock=clock)
    transport.fail_next(1)
    clock.advance("5s")
    failed, published = publish(transport, command(2)).outcomes
    assert failed.failure is not None and failed.failure.failed_at == T0 + timedelta(seconds=5)
    assert published.published_at == T0 + timedelta(seconds=5)


def test_published_messages_do_not_share_the_callers_trace_carrier() -> None:
    trace = {"traceparent": "00-abc-def-01"}
    sent = PublishWakeupsCommand([attempt(0, message(trace=trace))])
    transport = RecordingTransport()
    publish(transport, sent)
    trace["traceparent"] = "changed"
    assert transport.published[0].trace_carrier == {"traceparent": "00-abc-def-01"}


@pytest.mark.parametrize(("name", "clock"), [("", None), (None, None), ("recording", object())])
def test_bad_constructor_arguments_are_rejected(name: Any, clock: Any) -> None:
    expect_error(ErrorCode.CONFIGURATION_INVALID, lambda: RecordingTransport(name=name, clock=clock))


def test_a_transport_lane_starts_and_closes_the_recording_transport() -> None:
    transport = RecordingTransport(name="wakeups")
    lane = create_lane(
        storage=local_storage_driver(), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
    )
    assert lane.delivery.transport is transport

    async def main() -> None:
        await lane.start()
        assert transport.lifecycle == ["start"]
        await lane.close()

    asyncio.run(main())
    assert transport.lifecycle == ["start", "close"]
    assert repr(transport) == "RecordingTransport(name='wakeups', published=0)"


# ---------------------------------------------------------------------------------------------
# Conformance: the recording transport and a minimal one pass


class RecordingSuite(TransportConformance):
    """The suite with every optional hook answered by ``RecordingTransport``."""

    def published_messages(self, transport: RecordingTransport) -> list[DeliveryMessage]:
        return transport.published

    def fail_next_attempts(self, transport: RecordingTransport, count: int) -> bool:
        transport.fail_next(count)
        return True

    def fail_next_operation(self, transport: RecordingTransport) -> bool:
        transport.fail_operation_next(1)
        return True


class TestRecordingTransportConformance(RecordingSuite):
    @pytest.fixture
    def transport(self) -> RecordingTransport:
        return RecordingTransport()


class MinimalTransport:
    """Only a name and an async publish: no lifecycle hooks, no way to inject failures."""

    name = "minimal"

    async def publish_wakeups(self, command: object) -> PublishWakeupsResult:
        checked = validate_publish_wakeups_command(command)
        now = datetime.now(UTC)
        return PublishWakeupsResult(published_outcome(now) for _ in checked.attempts)


class TestMinimalTransportConformance(TransportConformance):
    wakeup_queues = ("only",)

    @pytest.fixture
    def transport(self) -> MinimalTransport:
        return MinimalTransport()


def test_no_suite_test_is_skipped_for_the_recording_transport() -> None:
    # The hook-dependent tests skip only for transports that cannot support the hooks.
    for name in sorted(name for name in dir(TransportConformance) if name.startswith("test_")):
        try:
            run_suite_test(name, RecordingTransport)
        except pytest.skip.Exception as skipped:
            pytest.fail(f"{name} was skipped for RecordingTransport: {skipped}")


# ---------------------------------------------------------------------------------------------
# Conformance can fail


class DroppingTransport(RecordingTransport):
    """Loses the last outcome of every call (as if a provider response entry went missing)."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        return PublishWakeupsResult(result.outcomes[:-1])


class DuplicatingTransport(RecordingTransport):
    """Answers with one outcome too many."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        return PublishWakeupsResult((*result.outcomes, result.outcomes[-1]))


class ReorderingTransport(RecordingTransport):
    """Returns the right outcomes in the wrong order (e.g. grouped by provider queue, never re-indexed)."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        return PublishWakeupsResult(reversed(result.outcomes))


class TrustingTransport(RecordingTransport):
    """Publishes whatever it is handed, without validating the command."""

    async def publish_wakeups(self, command: Any) -> PublishWakeupsResult:
        outcomes = []
        for item in getattr(command, "attempts", None) or ():
            self.published.append(getattr(item, "message", item))
            outcomes.append(published_outcome(datetime.now(UTC)))
        return PublishWakeupsResult(outcomes)


class PrefixPublishingTransport(RecordingTransport):
    """Validates and publishes attempt by attempt, so a bad attempt leaves its valid prefix published."""

    async def publish_wakeups(self, command: Any) -> PublishWakeupsResult:
        if not isinstance(command, PublishWakeupsCommand) or not isinstance(getattr(command, "attempts", None), tuple):
            return await super().publish_wakeups(command)
        outcomes = []
        for item in command.attempts:
            single = validate_publish_wakeups_command(forge(PublishWakeupsCommand, attempts=(item,)))
            self.published.append(single.attempts[0].message)
            outcomes.append(published_outcome(datetime.now(UTC)))
        return PublishWakeupsResult(outcomes)


class WrongCodeTransport(RecordingTransport):
    """Rejects malformed commands, but with a provider-style error instead of the contract code."""

    async def publish_wakeups(self, command: Any) -> PublishWakeupsResult:
        try:
            return await super().publish_wakeups(command)
        except RunlaneError as error:
            raise ValueError(f"bad request: {error.message}") from None


class RaisingOnRejectTransport(RecordingTransport):
    """Raises for a provider-rejected attempt instead of answering it with a failed outcome."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        if any(outcome.type is FAILED for outcome in result.outcomes):
            raise RunlaneError(ErrorCode.TRANSPORT_PUBLISH_FAILED, "one entry failed", retryable=True)
        return result


class SwallowingOutageTransport(RecordingTransport):
    """Turns an outage into failed outcomes although it never reached the provider."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        try:
            return await super().publish_wakeups(command)
        except RunlaneError as error:
            if error.code is ErrorCode.ADAPTER_CONTRACT_VIOLATION:
                raise
            return PublishWakeupsResult(failed_outcome() for _ in command.attempts)


class TimelessTransport(RecordingTransport):
    """Reports published outcomes without a published_at."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        return forge(
            PublishWakeupsResult,
            outcomes=tuple(
                WakeupPublishOutcome.model_construct(type=PUBLISHED) if outcome.type is PUBLISHED else outcome
                for outcome in result.outcomes
            ),
        )


class SyncTransport(RecordingTransport):
    """A blocking publish_wakeups: returns the result instead of an awaitable."""

    def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:  # type: ignore[override]
        coroutine = RecordingTransport.publish_wakeups(self, command)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        raise AssertionError("RecordingTransport.publish_wakeups never suspends")


class MutatingTransport(RecordingTransport):
    """Stamps its own header into the caller's trace carriers."""

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        for item in command.attempts:
            if item.message.trace_carrier is not None:
                item.message.trace_carrier["x-provider"] = "seen"
        return result


class NamelessTransport(RecordingTransport):
    def __init__(self) -> None:
        super().__init__()
        self.name = ""


class SharedBatchTransport(RecordingTransport):
    """Buffers attempts from overlapping calls into one provider batch, then answers every call with it."""

    def __init__(self) -> None:
        super().__init__()
        self._batch: list[WakeupPublishOutcome] = []

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        result = await super().publish_wakeups(command)
        self._batch.extend(result.outcomes)
        await asyncio.sleep(0.01)
        outcomes, self._batch = tuple(self._batch), []
        return PublishWakeupsResult(outcomes or result.outcomes)


COUNT_TESTS = [
    "test_adapter_shape",
    "test_returns_one_valid_outcome_per_attempt",
    "test_single_attempt_command",
    "test_republishing_an_outbox_message_is_accepted",
    "test_concurrent_publishes_get_their_own_outcomes",
    "test_failed_outcomes_carry_a_failure_record",
    "test_outcomes_follow_attempt_order",
    "test_operation_failure_raises_and_publishes_nothing",
    "test_malformed_publish_commands_are_rejected",
]

EXPECTED_FAILURES: dict[type[Any], list[str]] = {
    DroppingTransport: COUNT_TESTS,
    DuplicatingTransport: COUNT_TESTS,
    ReorderingTransport: ["test_outcomes_follow_attempt_order"],
    TrustingTransport: ["test_malformed_publish_commands_are_rejected", "test_empty_command_is_rejected"],
    PrefixPublishingTransport: ["test_malformed_publish_commands_are_rejected"],
    WrongCodeTransport: [
        "test_malformed_publish_commands_are_rejected",
        "test_empty_command_is_rejected",
        "test_operation_failure_raises_and_publishes_nothing",
    ],
    RaisingOnRejectTransport: ["test_failed_outcomes_carry_a_failure_record", "test_outcomes_follow_attempt_order"],
    SwallowingOutageTransport: ["test_operation_failure_raises_and_publishes_nothing"],
    TimelessTransport: [
        "test_adapter_shape",
        "test_returns_one_valid_outcome_per_attempt",
        "test_single_attempt_command",
    ],
    SyncTransport: ["test_adapter_shape", "test_returns_one_valid_outcome_per_attempt"],
    MutatingTransport: ["test_returns_one_valid_outcome_per_attempt"],
    NamelessTransport: ["test_adapter_shape"],
    SharedBatchTransport: ["test_concurrent_publishes_get_their_own_outcomes"],
}


def run_suite_test(name: str, transport_class: type[Any]) -> None:
    getattr(RecordingSuite(), name)(transport=transport_class())


@pytest.mark.parametrize(
    ("transport_class", "name"),
    [(transport_class, name) for transport_class, names in EXPECTED_FAILURES.items() for name in names],
    ids=lambda value: value.__name__ if isinstance(value, type) else value,
)
def test_a_broken_transport_fails_the_guarding_test(transport_class: type[Any], name: str) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        run_suite_test(name, transport_class)


def test_every_expected_failure_names_a_suite_test() -> None:
    names = {name for names in EXPECTED_FAILURES.values() for name in names}
    suite = {name for name in dir(TransportConformance) if name.startswith("test_")}
    assert names <= suite, names - suite


def test_the_wrong_count_failure_names_the_counts() -> None:
    with pytest.raises(AssertionError, match="returned 4 outcomes for 5 attempts"):
        run_suite_test("test_returns_one_valid_outcome_per_attempt", DroppingTransport)
