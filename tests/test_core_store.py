"""The core storage layer (``runlane.core.store``) and group commit (``runlane.storage.batching``)
over the in-memory driver with a controlled clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from runlane_local import local_storage_driver

from runlane.storage.batching import Batcher
from runlane.core.store import (
    AppendResult,
    ClaimRequest,
    CompletionRequest,
    CoreStore,
    CreateRunPlan,
    HeartbeatRequest,
    NextClaimRequest,
    completion_wait_key,
    idempotency_owner_key,
    queue_capacity_key,
    run_index_entries,
    singleton_owner_key,
)
from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, is_storage_conflict
from runlane.models import (
    Actor,
    DeliveryIntent,
    Environment,
    RunCancellationRequestedEvent,
    RunCompletionWaitCondition,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunFailedEvent,
    RunFailure,
    RunLease,
    RunLeaseClaimedEvent,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunStartedEvent,
    RunSucceededEvent,
    SignalWaitCondition,
)
from runlane.storage import (
    NewStorageRecord,
    StorageDocument,
    StorageIndexName,
    StorageLimitError,
    StorageLimits,
    StorageRecordKey,
    decode_run_document,
    encode_iso_date,
    run_key,
)
from runlane.testing import ControlledClock
from runlane.vocabulary import (
    ActorType,
    ExecuteDeliveryIgnoredReason,
    RunSourceType,
    RunStatus,
    TriggerOutcomeType,
)

ENV = Environment(name="test-env")
ENV_KEY = "test-env"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SYSTEM = Actor(type=ActorType.SYSTEM)
WORKER = Actor(type=ActorType.WORKER, id="w1")


class CountingDriver:
    """Wraps a driver to count transactions (and optionally fail the next ones with a limit error)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.profile = inner.profile
        self.transactions = 0

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def get(self, keys):
        return await self.inner.get(keys)

    async def query(self, query):
        return await self.inner.query(query)

    async def with_transaction(self, callback):
        self.transactions += 1
        return await self.inner.with_transaction(callback)


def make_store(*, queue_limits=None, limits=None, clock=None):
    clock = clock or ControlledClock(T0)
    driver = CountingDriver(local_storage_driver(clock=clock, limits=limits))
    return CoreStore(driver, ENV, queue_limits=queue_limits), clock, driver


def created_event(run_id: str, at: datetime, **fields) -> RunCreatedEvent:
    fields.setdefault("task_id", "emails.send")
    fields.setdefault("queue", "q")
    return RunCreatedEvent(
        run_id=run_id, environment=ENV, occurred_at=at, actor=SYSTEM, payload={"n": run_id}, **fields
    )


def delivery_event(run_id: str, at: datetime, queue: str = "q", available_at: datetime | None = None):
    return RunDeliveryRequestedEvent(
        run_id=run_id,
        environment=ENV,
        occurred_at=at,
        actor=SYSTEM,
        delivery=DeliveryIntent(
            environment=ENV, run_id=run_id, queue=queue, requested_at=at, available_at=available_at or at
        ),
    )


def trigger_plan(run_id: str, at: datetime = T0, *, available_at=None, **fields) -> CreateRunPlan:
    queue = fields.get("queue", "q")
    return CreateRunPlan(created_event(run_id, at, **fields), (delivery_event(run_id, at, queue, available_at),))


def run_now_plan(run_id: str, at: datetime = T0, *, token="tok-now", lease_ms=30_000, **fields) -> CreateRunPlan:
    lease = RunLease(worker_id="w1", token=token, claimed_at=at, expires_at=at + timedelta(milliseconds=lease_ms))
    return CreateRunPlan(
        created_event(run_id, at, **fields),
        (
            RunLeaseClaimedEvent(run_id=run_id, environment=ENV, occurred_at=at, actor=WORKER, lease=lease),
            RunStartedEvent(run_id=run_id, environment=ENV, occurred_at=at, actor=WORKER, attempt=1),
        ),
    )


def claim(
    run_id: str,
    token: str = "tok",
    *,
    queue: str | None = "q",
    lease_ms=30_000,
    start=True,
    worker="w1",
    deadline_ms=None,
):
    return ClaimRequest(run_id, queue, worker, token, lease_ms, attempt_deadline_ms=deadline_ms, also_start=start)


def succeed(output=None):
    def build(run: RunRecord, now: datetime):
        return [
            RunSucceededEvent(
                run_id=run.id,
                environment=run.environment,
                occurred_at=now,
                actor=WORKER,
                attempt=run.counters.attempts,
                output=output,
                has_output=output is not None,
            )
        ]

    return build


def fail():
    def build(run: RunRecord, now: datetime):
        failure = RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.")
        return [
            RunFailedEvent(
                run_id=run.id,
                environment=run.environment,
                occurred_at=now,
                actor=WORKER,
                attempt=run.counters.attempts,
                failure=failure,
            )
        ]

    return build


def retry(delay_ms: int = 1000):
    def build(run: RunRecord, now: datetime):
        failure = RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.", retryable=True)
        return [
            RunRetryScheduledEvent(
                run_id=run.id,
                environment=run.environment,
                occurred_at=now,
                actor=WORKER,
                attempt=run.counters.attempts,
                failure=failure,
                delay=f"{delay_ms}ms",
                retry_at=now + timedelta(milliseconds=delay_ms),
            )
        ]

    return build


def release_for_run(source_run_id: str):
    def build(run: RunRecord, now: datetime):
        return [
            RunReleasedEvent(
                run_id=run.id,
                environment=run.environment,
                occurred_at=now,
                actor=WORKER,
                attempt=run.counters.attempts,
                wait=RunCompletionWaitCondition(run_id=source_run_id),
            )
        ]

    return build


def release_for_signal(signal_key: str):
    def build(run: RunRecord, now: datetime):
        return [
            RunReleasedEvent(
                run_id=run.id,
                environment=run.environment,
                occurred_at=now,
                actor=WORKER,
                attempt=run.counters.attempts,
                wait=SignalWaitCondition(signal_key=signal_key),
            )
        ]

    return build


def request_cancellation(run: RunRecord, now: datetime):
    return [RunCancellationRequestedEvent(run_id=run.id, environment=run.environment, occurred_at=now, actor=SYSTEM)]


async def raw(store: CoreStore, key: StorageRecordKey):
    (record,) = await store.driver.get([key])
    return None if record is None else record.document.value


async def children_of(store: CoreStore, run_id: str):
    (record,) = await store.driver.get([run_key(ENV_KEY, run_id)])
    return decode_run_document(record.document)[1]


async def start_run(store: CoreStore, run_id: str, token: str = "tok", **fields) -> RunRecord:
    """Create an unbounded-queue run and claim + start it."""
    await store.create_run(trigger_plan(run_id, **fields))
    (result,) = await store.claim([claim(run_id, token, queue=fields.get("queue", "q"))])
    assert result.claimed, result
    return result.run


# ---------------------------------------------------------------------------------------------
# Creation


async def test_unbounded_trigger_creates_a_queued_run_with_its_delivery_request():
    store, _, _ = make_store()
    result = await store.create_run(trigger_plan("run_1"))
    assert result.outcome is TriggerOutcomeType.CREATED and result.created
    assert result.run.status is RunStatus.QUEUED and result.run.event_sequence == 2
    assert [record.sequence for record in result.events] == [1, 2]
    assert [record.event.type.value for record in result.events] == ["run.created", "run.delivery_requested"]
    assert all(record.id.startswith("evt_") and len(record.id) == 36 for record in result.events)
    assert len({record.id for record in result.events}) == 2
    # What the result reports is exactly what was persisted.
    assert await store.list_events("run_1") == list(result.events)
    assert await store.get_run("run_1") == result.run
    assert (await children_of(store, "run_1")).events == 2
    assert await store.query_index(StorageIndexName.RUNS_RUNNABLE, ("q",)) == ["run_1"]


async def test_bounded_trigger_creates_only_the_created_event_and_takes_no_capacity():
    store, _, _ = make_store(queue_limits={"q": 1})
    result = await store.create_run(CreateRunPlan(created_event("run_1", T0)))
    assert result.run.status is RunStatus.QUEUED and result.run.event_sequence == 1
    assert [record.event.type.value for record in result.events] == ["run.created"]
    assert await raw(store, queue_capacity_key(ENV_KEY, "q", None)) is None


async def test_run_now_creates_a_running_started_run_and_occupies_capacity():
    store, _, _ = make_store(queue_limits={"q": 2})
    result = await store.create_run(run_now_plan("run_1", lease_ms=10_000))
    run = result.run
    assert run.status is RunStatus.RUNNING and run.counters.attempts == 1 and run.lease.token == "tok-now"
    assert [record.event.type.value for record in result.events] == ["run.created", "run.lease_claimed", "run.started"]
    assert (await children_of(store, "run_1")).events == 3
    occupants = (await raw(store, queue_capacity_key(ENV_KEY, "q", None)))["occupants"]
    assert occupants == {"run_1": encode_iso_date(T0 + timedelta(seconds=10))}


async def test_an_explicit_run_id_that_exists_is_an_event_sequence_conflict():
    store, _, _ = make_store()
    await store.create_run(trigger_plan("run_1"))
    with pytest.raises(RunlaneError) as caught:
        await store.create_run(trigger_plan("run_1"))
    assert is_storage_conflict(caught.value, StorageConflictKind.EVENT_SEQUENCE)
    assert (await store.get_run("run_1")).event_sequence == 2


# ---------------------------------------------------------------------------------------------
# Idempotency


async def test_a_live_idempotency_owner_returns_its_run_without_writing():
    store, _, _ = make_store()
    first = await store.create_run(trigger_plan("run_1", idempotency_key="k", idempotency_key_ttl=60_000))
    again = await store.create_run(trigger_plan("run_2", idempotency_key="k", idempotency_key_ttl=60_000))
    assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING and not again.created
    assert again.run == first.run and again.events == ()
    assert await store.get_run("run_2") is None
    assert await store.find_idempotent_run("emails.send", "k") == first.run
    owner = await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k"))
    assert owner == {"run_id": "run_1", "ttl": 60_000, "expires_at": None}
    # Ownership is per task id: another task with the same key creates its own run.
    other = await store.create_run(trigger_plan("run_3", idempotency_key="k", task_id="other.task"))
    assert other.created


async def test_a_failed_run_releases_its_idempotency_owner():
    store, _, _ = make_store()
    run = await start_run(store, "run_1", idempotency_key="k", idempotency_key_ttl=60_000)
    await store.append("run_1", fail(), expected_lease_token=run.lease.token)
    assert await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k")) is None
    assert await store.find_idempotent_run("emails.send", "k") is None
    again = await store.create_run(trigger_plan("run_2", idempotency_key="k"))
    assert again.created and again.run.id == "run_2"


async def test_an_active_ttl_owner_is_released_at_any_terminal_state():
    store, _, _ = make_store()
    run = await start_run(store, "run_1", idempotency_key="k", idempotency_key_ttl="active")
    assert (
        await store.create_run(trigger_plan("run_x", idempotency_key="k"))
    ).outcome is TriggerOutcomeType.RETURNED_EXISTING
    await store.append("run_1", succeed({"ok": True}), expected_lease_token=run.lease.token)
    assert await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k")) is None
    assert (await store.create_run(trigger_plan("run_2", idempotency_key="k"))).created


async def test_a_finite_ttl_owner_is_retained_after_success_until_it_expires():
    store, clock, _ = make_store()
    run = await start_run(store, "run_1", idempotency_key="k", idempotency_key_ttl=5_000)
    clock.advance("1s")
    done = await store.append("run_1", succeed(), expected_lease_token=run.lease.token)
    owner = await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k"))
    assert owner == {"run_id": "run_1", "ttl": 5_000, "expires_at": encode_iso_date(T0 + timedelta(seconds=6))}
    clock.advance("4999ms")
    retained = await store.create_run(trigger_plan("run_2", idempotency_key="k"))
    assert retained.outcome is TriggerOutcomeType.RETURNED_EXISTING and retained.run == done.run
    assert await store.find_idempotent_run("emails.send", "k") == done.run
    clock.advance("1ms")
    assert await store.find_idempotent_run("emails.send", "k") is None
    fresh = await store.create_run(trigger_plan("run_2", idempotency_key="k"))
    assert fresh.created
    assert (await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k")))["run_id"] == "run_2"


async def test_racing_idempotent_creators_produce_exactly_one_run():
    store, _, _ = make_store()
    results = await asyncio.gather(
        *(store.create_run(trigger_plan(f"run_{i}", idempotency_key="k")) for i in range(12))
    )
    created = [result for result in results if result.created]
    assert len(created) == 1
    winner = created[0].run
    assert all(result.run == winner for result in results)
    assert [await store.get_run(f"run_{i}") is not None for i in range(12)].count(True) == 1


async def test_reset_idempotency_key_keeps_an_active_owner_and_clears_a_missing_one():
    store, _, _ = make_store()
    assert await store.reset_idempotency_key("emails.send", "k") is None  # no owner: nothing to do
    await store.create_run(trigger_plan("run_1", idempotency_key="k"))
    active = await store.reset_idempotency_key("emails.send", "k")
    assert active is not None and active.id == "run_1"
    assert not (await store.create_run(trigger_plan("run_2", idempotency_key="k"))).created


# ---------------------------------------------------------------------------------------------
# Singleton


async def test_a_second_active_singleton_owner_is_rejected_until_the_first_finishes():
    store, _, _ = make_store()
    run = await start_run(store, "run_1", singleton_key="s")
    with pytest.raises(RunlaneError) as caught:
        await store.create_run(trigger_plan("run_2", singleton_key="s"))
    assert is_storage_conflict(caught.value, StorageConflictKind.SINGLETON_KEY)
    assert caught.value.meta["run_id"] == "run_1"
    assert await store.get_run("run_2") is None
    assert (await store.find_singleton_run("s")).id == "run_1"
    await store.append("run_1", succeed(), expected_lease_token=run.lease.token)
    assert await raw(store, singleton_owner_key(ENV_KEY, "s")) is None
    assert await store.find_singleton_run("s") is None
    assert (await store.create_run(trigger_plan("run_2", singleton_key="s"))).created
    assert await raw(store, singleton_owner_key(ENV_KEY, "s")) == {"run_id": "run_2"}


async def test_racing_singleton_creators_leave_one_owner():
    store, _, _ = make_store()
    outcomes = await asyncio.gather(
        *(store.create_run(trigger_plan(f"run_{i}", singleton_key="s")) for i in range(8)), return_exceptions=True
    )
    created = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    rejected = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    assert len(created) == 1
    assert all(is_storage_conflict(error, StorageConflictKind.SINGLETON_KEY) for error in rejected)


# ---------------------------------------------------------------------------------------------
# Index entries


def test_run_index_entries_follow_the_status():
    run = RunRecord(
        id="r",
        environment=ENV,
        task_id="t",
        queue="q",
        status=RunStatus.QUEUED,
        event_sequence=1,
        created_at=T0,
        updated_at=T0,
        source=RunSource(type=RunSourceType.RERUN, source_run_id="parent"),
    )
    entries = {entry.name: (entry.partition, entry.sort) for entry in run_index_entries(run)}
    iso = encode_iso_date(T0)
    assert entries == {
        StorageIndexName.RUNS_RUNNABLE: ((ENV_KEY, "q"), (iso, "r")),
        StorageIndexName.RUNS_BY_SOURCE_RUN: ((ENV_KEY, "parent"), (iso,)),
    }
    lease = RunLease(worker_id="w", token="t", claimed_at=T0, expires_at=T0 + timedelta(minutes=1))
    running = run.model_copy(
        update={
            "status": RunStatus.RUNNING,
            "lease": lease,
            "started_at": T0,
            "attempt_deadline_at": T0 + timedelta(minutes=5),
            "source": None,
        }
    )
    expiry = encode_iso_date(lease.expires_at)
    assert {entry.name: entry.sort for entry in run_index_entries(running)} == {
        StorageIndexName.RUNS_RUNNABLE: (expiry, "r"),
        StorageIndexName.RUNS_NEEDING_DELIVERY: (expiry, "r"),
        StorageIndexName.RUNS_NEEDING_TIMEOUT_FINALIZATION: (encode_iso_date(T0 + timedelta(minutes=5)), "r"),
    }
    cancelling = running.model_copy(update={"status": RunStatus.CANCELLATION_REQUESTED})
    assert {entry.name: entry.sort for entry in run_index_entries(cancelling)} == {
        StorageIndexName.RUNS_NEEDING_CANCELLATION_FINALIZATION: (expiry, "r"),
    }
    waiting = run.model_copy(
        update={"status": RunStatus.RELEASED, "wait": SignalWaitCondition(signal_key="sig"), "source": None}
    )
    assert {entry.name: entry.partition for entry in run_index_entries(waiting)} == {
        StorageIndexName.RUNS_WAITING_FOR_SIGNAL: (ENV_KEY, "sig"),
    }
    finished = run.model_copy(update={"status": RunStatus.SUCCEEDED, "finished_at": T0, "source": None})
    assert {entry.name: entry.sort for entry in run_index_entries(finished)} == {
        StorageIndexName.RUNS_TERMINAL_BY_FINISHED_AT: (iso, "r"),
    }


async def test_runnable_scan_returns_due_runs_oldest_first_with_the_queues_taking_turns():
    store, clock, _ = make_store()
    await store.create_run(trigger_plan("late_a", T0 + timedelta(seconds=3), queue="a"))
    await store.create_run(trigger_plan("early_b", T0 + timedelta(seconds=1), queue="b"))
    await store.create_run(trigger_plan("mid_a", T0 + timedelta(seconds=2), queue="a"))
    await store.create_run(trigger_plan("future", T0, queue="a", available_at=T0 + timedelta(minutes=1)))
    await store.create_run(trigger_plan("leased", T0, queue="b"))
    await store.create_run(trigger_plan("other_queue", T0, queue="c"))
    await store.create_run(trigger_plan("done", T0, queue="a"))
    clock.set(T0 + timedelta(seconds=5))
    (leased,) = await store.claim([claim("leased", queue="b", lease_ms=10_000)])
    (done,) = await store.claim([claim("done", "tok-done", queue="a")])
    assert leased.claimed and done.claimed
    await store.append("done", succeed(), expected_lease_token="tok-done")

    now = clock.now()
    # Each queue's oldest before any queue's second; which queue goes first rotates from call to call.
    refs = await store.list_runnable(["a", "b"], now, 10)
    assert [(ref.run_id, ref.queue) for ref in refs] == [("mid_a", "a"), ("early_b", "b"), ("late_a", "a")]
    assert refs[1].available_at == T0 + timedelta(seconds=1)
    assert [ref.run_id for ref in await store.list_runnable(["a", "b"], now, 2)] == ["early_b", "mid_a"]
    # The expired lease makes the running run runnable (and recoverable) again.
    later = T0 + timedelta(seconds=16)
    assert [ref.run_id for ref in await store.list_runnable(["b"], later, 10)] == ["early_b", "leased"]
    assert "leased" in await store.query_index(StorageIndexName.RUNS_NEEDING_DELIVERY, until=later)
    assert "leased" not in await store.query_index(StorageIndexName.RUNS_NEEDING_DELIVERY, until=now)
    assert await store.query_index(StorageIndexName.RUNS_TERMINAL_BY_FINISHED_AT) == ["done"]
    # The future run becomes due at its time.
    assert "future" in [ref.run_id for ref in await store.list_runnable(["a"], T0 + timedelta(minutes=1), 10)]


# ---------------------------------------------------------------------------------------------
# Claims


async def test_one_transaction_claims_many_runs():
    store, _, driver = make_store()
    for i in range(10):
        await store.create_run(trigger_plan(f"run_{i}"))
    before = driver.transactions
    results = await store.claim([claim(f"run_{i}", f"tok_{i}") for i in range(10)])
    assert driver.transactions == before + 1
    assert all(result.claimed and result.reason is None for result in results)
    for i, result in enumerate(results):
        assert result.run.status is RunStatus.RUNNING and result.run.lease.token == f"tok_{i}"
        assert result.run.counters.attempts == 1
        assert [record.event.type.value for record in result.events] == ["run.lease_claimed", "run.started"]
        assert await store.list_events(f"run_{i}") == [*(await store.list_events(f"run_{i}"))[:2], *result.events]
        assert (await children_of(store, f"run_{i}")).events == 4
    ids = [record.id for result in results for record in result.events]
    assert len(set(ids)) == len(ids)


async def test_claim_reasons():
    store, _, _ = make_store()
    await store.create_run(trigger_plan("queued"))
    await store.create_run(trigger_plan("future", available_at=T0 + timedelta(minutes=1)))
    await store.create_run(trigger_plan("other", queue="other"))
    await start_run(store, "running", "tok-r")
    finished = await start_run(store, "finished", "tok-f")
    await store.append("finished", succeed(), expected_lease_token=finished.lease.token)
    cancelling = await start_run(store, "cancelling", "tok-c")
    await store.append("cancelling", request_cancellation)
    del cancelling
    results = await store.claim(
        [
            claim("missing"),
            claim("other"),
            claim("finished"),
            claim("future"),
            claim("running"),
            claim("cancelling"),
            claim("queued"),
            claim("queued", "tok-dup"),
        ]
    )
    assert [result.reason for result in results] == [
        ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND,
        ExecuteDeliveryIgnoredReason.WRONG_QUEUE,
        ExecuteDeliveryIgnoredReason.TERMINAL,
        ExecuteDeliveryIgnoredReason.NOT_DUE,
        ExecuteDeliveryIgnoredReason.ALREADY_LEASED,
        ExecuteDeliveryIgnoredReason.ALREADY_LEASED,
        None,
        ExecuteDeliveryIgnoredReason.ALREADY_LEASED,  # the same run twice in one batch: the first wins
    ]
    assert results[6].run.lease.token == "tok"
    # queue=None claims from any queue.
    (anywhere,) = await store.claim([claim("other", queue=None)])
    assert anywhere.claimed


def next_claim(*queues: str, worker: str = "w1", lease_ms: int = 30_000, deadline_ms=None) -> NextClaimRequest:
    return NextClaimRequest(tuple(queues or ("q",)), worker, lease_ms, deadline_ms)


async def test_claim_next_claims_the_oldest_due_runs_of_its_queues_in_one_transaction():
    store, clock, driver = make_store()
    await store.create_run(trigger_plan("late_a", T0 + timedelta(seconds=3), queue="a"))
    await store.create_run(trigger_plan("early_b", T0 + timedelta(seconds=1), queue="b"))
    await store.create_run(trigger_plan("mid_a", T0 + timedelta(seconds=2), queue="a"))
    await store.create_run(trigger_plan("future", T0, queue="a", available_at=T0 + timedelta(minutes=1)))
    await store.create_run(trigger_plan("other_queue", T0, queue="c"))
    clock.set(T0 + timedelta(seconds=5))
    before = driver.transactions
    results = await store.claim_next([next_claim("a", "b"), next_claim("a", "b")], clock.now())
    assert driver.transactions == before + 1
    assert [result.run_id for result in results] == ["mid_a", "early_b"]  # each queue's oldest, a first
    for result in results:
        assert result.claimed and result.run.status is RunStatus.RUNNING and result.run.lease.worker_id == "w1"
        assert [record.event.type.value for record in result.events] == ["run.lease_claimed", "run.started"]
    assert results[0].run.lease.token != results[1].run.lease.token
    # One due run is left for three requests; the others get None (nothing due for them).
    left = await store.claim_next([next_claim("a", "b")] * 3, clock.now())
    assert [None if result is None else result.run_id for result in left] == ["late_a", None, None]
    assert await store.claim_next([next_claim("a", "b")], clock.now()) == [None]
    # Requests for other queues or leases are separate groups, each claiming from its own queues.
    (other,) = await store.claim_next([next_claim("c", worker="w2", deadline_ms=5_000)], clock.now())
    assert other.run_id == "other_queue" and other.run.lease.worker_id == "w2"
    assert other.run.attempt_deadline_at == clock.now() + timedelta(seconds=5)


async def test_claim_next_takes_the_task_deadline_and_reports_full_capacity_as_claim_lost():
    store, clock, _ = make_store(queue_limits={"q": 1})
    for i in range(3):
        await store.create_run(trigger_plan(f"run_{i}", T0 + timedelta(seconds=i)))
    clock.set(T0 + timedelta(seconds=5))
    deadlines = {"run_0": 7_000}
    results = await store.claim_next([next_claim(), next_claim()], clock.now(), lambda run: deadlines.get(run.id))
    assert results[0].claimed and results[0].run_id == "run_0"
    assert results[0].run.attempt_deadline_at == clock.now() + timedelta(seconds=7)
    assert not results[1].claimed and results[1].reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
    occupants = (await raw(store, queue_capacity_key(ENV_KEY, "q", None)))["occupants"]
    assert set(occupants) == {"run_0"}


async def test_racing_claim_next_callers_claim_each_run_once():
    store, clock, _ = make_store()
    for i in range(20):
        await store.create_run(trigger_plan(f"run_{i:02}", T0 + timedelta(milliseconds=i)))
    clock.set(T0 + timedelta(seconds=5))
    batches = await asyncio.gather(
        *(store.claim_next([next_claim(worker=f"w{w}")] * 4, clock.now()) for w in range(6))
    )
    claimed = [result.run_id for batch in batches for result in batch if result is not None and result.claimed]
    assert sorted(claimed) == [f"run_{i:02}" for i in range(20)]
    for run in await store.get_runs([f"run_{i:02}" for i in range(20)]):
        assert run.status is RunStatus.RUNNING and run.counters.attempts == 1 and run.event_sequence == 4


async def test_racing_claim_batches_have_one_winner_per_run():
    store, _, _ = make_store()
    for i in range(6):
        await store.create_run(trigger_plan(f"run_{i}"))
    batches = await asyncio.gather(
        *(store.claim([claim(f"run_{i}", f"w{w}_tok_{i}", worker=f"w{w}") for i in range(6)]) for w in range(4))
    )
    for i in range(6):
        outcomes = [batch[i] for batch in batches]
        winners = [outcome for outcome in outcomes if outcome.claimed]
        assert len(winners) == 1
        assert {outcome.reason for outcome in outcomes if not outcome.claimed} == {
            ExecuteDeliveryIgnoredReason.ALREADY_LEASED
        }
        stored = await store.get_run(f"run_{i}")
        assert stored.lease.token == winners[0].run.lease.token and stored.event_sequence == 4


async def test_racing_claims_never_exceed_bounded_queue_capacity():
    store, _, _ = make_store(queue_limits={"q": 2})
    for i in range(12):
        await store.create_run(CreateRunPlan(created_event(f"run_{i}", T0)))
    batches = await asyncio.gather(
        *(
            store.claim([claim(f"run_{(w * 5 + i) % 12}", f"w{w}_{i}", worker=f"w{w}") for i in range(6)])
            for w in range(5)
        )
    )
    claimed = {result.run_id for batch in batches for result in batch if result.claimed}
    assert len(claimed) == 2
    reasons = {result.reason for batch in batches for result in batch if not result.claimed}
    assert ExecuteDeliveryIgnoredReason.CLAIM_LOST in reasons
    occupants = (await raw(store, queue_capacity_key(ENV_KEY, "q", None)))["occupants"]
    assert set(occupants) == claimed
    running = [run for run in await store.get_runs([f"run_{i}" for i in range(12)]) if run.status is RunStatus.RUNNING]
    assert {run.id for run in running} == claimed


async def test_concurrency_keys_are_separate_capacity_partitions():
    store, _, _ = make_store(queue_limits={"q": 1})
    for i, key in enumerate(["a", "a", "b", "b", None, None]):
        await store.create_run(CreateRunPlan(created_event(f"run_{i}", T0, concurrency_key=key)))
    results = await store.claim([claim(f"run_{i}", f"tok_{i}") for i in range(6)])
    assert [result.claimed for result in results] == [True, False, True, False, True, False]
    assert {result.reason for result in results if not result.claimed} == {ExecuteDeliveryIgnoredReason.CLAIM_LOST}
    assert set((await raw(store, queue_capacity_key(ENV_KEY, "q", "a")))["occupants"]) == {"run_0"}
    assert set((await raw(store, queue_capacity_key(ENV_KEY, "q", "b")))["occupants"]) == {"run_2"}
    assert set((await raw(store, queue_capacity_key(ENV_KEY, "q", None)))["occupants"]) == {"run_4"}


async def test_expired_occupants_do_not_count_and_are_pruned_on_rewrite():
    store, clock, _ = make_store(queue_limits={"q": 1})
    for i in range(2):
        await store.create_run(CreateRunPlan(created_event(f"run_{i}", T0)))
    (first,) = await store.claim([claim("run_0", "tok_0", lease_ms=1_000)])
    assert first.claimed
    (blocked,) = await store.claim([claim("run_1", "tok_1")])
    assert blocked.reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
    clock.advance("1s")  # the lease expires exactly now: the occupant no longer counts
    (second,) = await store.claim([claim("run_1", "tok_1", lease_ms=5_000)])
    assert second.claimed
    occupants = (await raw(store, queue_capacity_key(ENV_KEY, "q", None)))["occupants"]
    assert occupants == {"run_1": encode_iso_date(T0 + timedelta(seconds=6))}


async def test_a_heartbeat_keeps_the_capacity_slot_and_finishing_frees_it():
    store, clock, _ = make_store(queue_limits={"q": 1})
    for i in range(2):
        await store.create_run(CreateRunPlan(created_event(f"run_{i}", T0)))
    (first,) = await store.claim([claim("run_0", "tok_0", lease_ms=1_000)])
    clock.advance("500ms")
    beat = await store.heartbeat("run_0", "tok_0", "w1", 1_000)
    assert beat.lease.expires_at == T0 + timedelta(milliseconds=1_500)
    assert beat.lease.claimed_at == first.run.lease.claimed_at
    clock.advance("600ms")  # past the original expiry, within the heartbeat's
    (blocked,) = await store.claim([claim("run_1", "tok_1")])
    assert blocked.reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
    await store.append("run_0", retry(), expected_lease_token="tok_0")
    assert await raw(store, queue_capacity_key(ENV_KEY, "q", None)) is None
    (second,) = await store.claim([claim("run_1", "tok_1")])
    assert second.claimed


# ---------------------------------------------------------------------------------------------
# Lease fencing


async def test_stale_lease_tokens_are_lease_ownership_conflicts():
    store, clock, _ = make_store()
    await start_run(
        store,
        "run_1",
        "tok_old",
    )
    clock.advance("31s")  # lease expired; another worker takes over
    (taken,) = await store.claim([claim("run_1", "tok_new", worker="w2")])
    assert taken.claimed
    for operation in (
        store.append("run_1", succeed(), expected_lease_token="tok_old"),
        store.heartbeat("run_1", "tok_old", "w1", 30_000),
        store.complete_step("run_1", "s", "step-token", "tok_old", 1, {"x": 1}),
    ):
        with pytest.raises(RunlaneError) as caught:
            await operation
        assert is_storage_conflict(caught.value, StorageConflictKind.LEASE_OWNERSHIP)
    (stale,) = await store.complete([CompletionRequest("run_1", succeed(), lease_token="tok_old")])
    assert is_storage_conflict(stale, StorageConflictKind.LEASE_OWNERSHIP)
    with pytest.raises(RunlaneError) as caught:
        await store.heartbeat("run_1", "tok_new", "w1", 30_000)  # right token, wrong worker
    assert is_storage_conflict(caught.value, StorageConflictKind.LEASE_OWNERSHIP)
    run = await store.get_run("run_1")
    assert run.status is RunStatus.RUNNING and run.lease.token == "tok_new"
    with pytest.raises(RunlaneError) as caught:
        await store.append("missing", succeed(), expected_lease_token="tok")
    assert is_storage_conflict(caught.value, StorageConflictKind.LEASE_OWNERSHIP)
    with pytest.raises(RunlaneError) as caught:
        await store.append("missing", succeed())
    assert caught.value.code is ErrorCode.RUN_NOT_FOUND


async def test_heartbeat_returns_cancellation_requested_runs():
    store, _, _ = make_store()
    run = await start_run(store, "run_1")
    await store.append("run_1", request_cancellation)
    beat = await store.heartbeat("run_1", run.lease.token, "w1", 30_000)
    assert beat.status is RunStatus.CANCELLATION_REQUESTED
    results = await store.heartbeat_many(
        [HeartbeatRequest("run_1", run.lease.token, "w1", 30_000, known=run), HeartbeatRequest("run_1", "bad", "w1", 1)]
    )
    assert results[0].event_sequence == beat.event_sequence + 1
    assert is_storage_conflict(results[1], StorageConflictKind.LEASE_OWNERSHIP)


async def test_a_batch_of_completions_reports_each_failure_in_place_and_commits_the_rest():
    store, _, driver = make_store()
    runs = [await start_run(store, f"run_{i}", f"tok_{i}", idempotency_key=f"k{i}") for i in range(4)]

    def broken(run, now):
        raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "boom")

    before = driver.transactions
    results = await store.complete(
        [
            CompletionRequest("run_0", succeed({"v": 0}), "tok_0", known=runs[0]),
            CompletionRequest("run_1", succeed(), "stale"),
            CompletionRequest("run_2", broken, "tok_2"),
            CompletionRequest("run_3", fail(), "tok_3"),
            CompletionRequest("run_3", succeed(), "tok_3"),  # the run already failed in this batch
        ]
    )
    assert driver.transactions == before + 1
    assert isinstance(results[0], AppendResult) and results[0].run.output == {"v": 0}
    assert is_storage_conflict(results[1], StorageConflictKind.LEASE_OWNERSHIP)
    assert isinstance(results[2], RunlaneError) and results[2].message == "boom"
    assert results[3].run.status is RunStatus.FAILED
    assert is_storage_conflict(results[4], StorageConflictKind.LEASE_OWNERSHIP)
    statuses = [run.status for run in await store.get_runs([f"run_{i}" for i in range(4)])]
    assert statuses == [RunStatus.SUCCEEDED, RunStatus.RUNNING, RunStatus.RUNNING, RunStatus.FAILED]
    assert await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k3")) is None
    assert (await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k0")))["expires_at"] is not None


async def test_an_empty_build_is_a_no_op():
    store, _, driver = make_store()
    await store.create_run(trigger_plan("run_1"))
    before = driver.transactions
    result = await store.append("run_1", lambda run, now: [])
    assert driver.transactions == before + 1
    assert result.events == () and result.run.event_sequence == 2
    assert (await store.get_run("run_1")).event_sequence == 2


# ---------------------------------------------------------------------------------------------
# Completion bookkeeping


async def test_completion_releases_every_owner_and_keeps_exact_child_counts():
    store, _, _ = make_store(queue_limits={"q": 3})
    await store.create_run(
        CreateRunPlan(
            created_event(
                "run_1", T0, idempotency_key="k", idempotency_key_ttl=1_000, singleton_key="s", concurrency_key="c"
            )
        )
    )
    (claimed,) = await store.claim([claim("run_1")])
    beat = await store.heartbeat("run_1", "tok", "w1", 30_000)
    assert (await raw(store, queue_capacity_key(ENV_KEY, "q", "c")))["occupants"] == {
        "run_1": encode_iso_date(beat.lease.expires_at)
    }
    step, created = await store.complete_step("run_1", "charge", "step-token", "tok", 1, {"charged": 10})
    assert created
    done = await store.append("run_1", succeed("ok"), expected_lease_token="tok")
    assert done.run.status is RunStatus.SUCCEEDED and done.run.output == "ok" and done.completion_waiters is False
    assert await raw(store, queue_capacity_key(ENV_KEY, "q", "c")) is None
    assert await raw(store, singleton_owner_key(ENV_KEY, "s")) is None
    assert (await raw(store, idempotency_owner_key(ENV_KEY, "emails.send", "k")))["expires_at"] == encode_iso_date(
        done.run.finished_at + timedelta(seconds=1)
    )
    children = await children_of(store, "run_1")
    events = await store.list_events("run_1")
    assert children.events == len(events) == done.run.event_sequence == 5
    assert [record.sequence for record in events] == [1, 2, 3, 4, 5]
    assert children.steps == 1
    del claimed, step


# ---------------------------------------------------------------------------------------------
# Steps


async def test_steps_are_fenced_idempotent_and_immutable():
    store, _, _ = make_store()
    run = await start_run(store, "run_1")
    step, created = await store.complete_step("run_1", "charge", "step-token", run.lease.token, 1, {"id": "ch_1"})
    assert created and step.output == {"id": "ch_1"} and step.completed_at == T0 and step.attempt == 1
    assert await store.get_step("run_1", "charge") == step
    again, created_again = await store.complete_step(
        "run_1", "charge", "step-token", run.lease.token, 1, {"id": "ch_1"}
    )
    assert again == step and created_again is False
    with pytest.raises(RunlaneError) as caught:
        await store.complete_step("run_1", "charge", "step-token", run.lease.token, 1, {"id": "ch_2"})
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION
    with pytest.raises(RunlaneError) as caught:
        await store.complete_step("run_1", "other", "step-token-2", run.lease.token, 2, None)  # wrong attempt
    assert is_storage_conflict(caught.value, StorageConflictKind.LEASE_OWNERSHIP)
    assert (await children_of(store, "run_1")).steps == 1
    assert await store.query_index(StorageIndexName.RUN_STEPS_BY_RUN, ("run_1",)) == ["charge"]
    await store.append("run_1", succeed(), expected_lease_token=run.lease.token)
    with pytest.raises(RunlaneError) as caught:
        await store.complete_step("run_1", "late", "step-token-3", run.lease.token, 1, 1)
    assert is_storage_conflict(caught.value, StorageConflictKind.LEASE_OWNERSHIP)


# ---------------------------------------------------------------------------------------------
# Completion waits


async def test_a_release_waiting_for_an_active_run_creates_the_marker():
    store, _, _ = make_store()
    await store.create_run(trigger_plan("source"))
    waiter = await start_run(store, "waiter")
    assert await store.has_completion_wait_marker("source") is False
    released = await store.append("waiter", release_for_run("source"), expected_lease_token=waiter.lease.token)
    assert released.run.status is RunStatus.RELEASED and len(released.events) == 1
    assert await store.has_completion_wait_marker("source") is True
    assert await raw(store, completion_wait_key(ENV_KEY, "source")) == {}
    assert await store.query_index(StorageIndexName.RUNS_WAITING_FOR_COMPLETION, ("source",)) == ["waiter"]
    (source,) = await store.claim([claim("source", "tok-s")])
    done = await store.append("source", succeed(), expected_lease_token="tok-s", known=source.run)
    assert done.completion_waiters is True
    # The waiter's own completion has no waiters.
    resumed = await store.append("waiter", lambda run, now: [delivery_event(run.id, now)])
    assert resumed.run.status is RunStatus.QUEUED
    assert await store.query_index(StorageIndexName.RUNS_WAITING_FOR_COMPLETION, ("source",)) == []


async def test_a_release_waiting_for_a_finished_run_resumes_in_the_same_commit():
    store, _, _ = make_store()
    source = await start_run(store, "source", "tok-s")
    await store.append("source", succeed(), expected_lease_token=source.lease.token)
    waiter = await start_run(store, "waiter")
    result = await store.append("waiter", release_for_run("source"), expected_lease_token=waiter.lease.token)
    assert [record.event.type.value for record in result.events] == ["run.released", "run.delivery_requested"]
    assert result.run.status is RunStatus.QUEUED and result.run.counters.releases == 1
    assert await store.has_completion_wait_marker("source") is False
    assert (await children_of(store, "waiter")).events == result.run.event_sequence


async def test_a_wait_for_a_run_that_does_not_exist_waits_for_it_with_its_marker():
    # An absent source is a run still to come (or one pruned to nothing, which cannot be told apart): the
    # waiter waits, and the marker makes the terminal commit of a run created later with that id look for it.
    store, _, _ = make_store()
    waiter = await start_run(store, "waiter")
    await store.append("waiter", release_for_run("later_run"), expected_lease_token=waiter.lease.token)
    assert await store.has_completion_wait_marker("later_run") is True
    run = await store.get_run("waiter")
    assert run is not None and run.status is RunStatus.RELEASED and run.wait.run_id == "later_run"
    assert await store.query_index(StorageIndexName.RUNS_WAITING_FOR_COMPLETION, ("later_run",)) == ["waiter"]


async def test_a_signal_wait_is_indexed_by_its_key():
    store, _, _ = make_store()
    waiter = await start_run(store, "waiter")
    await store.append("waiter", release_for_signal("payment.done"), expected_lease_token=waiter.lease.token)
    assert await store.query_index(StorageIndexName.RUNS_WAITING_FOR_SIGNAL, ("payment.done",)) == ["waiter"]
    assert await store.list_runnable(["q"], T0 + timedelta(days=365), 10) == []


# ---------------------------------------------------------------------------------------------
# Limits and group commit


SMALL_LIMITS = StorageLimits(
    max_point_reads=100,
    max_query_results=100,
    max_record_bytes=64 * 1024,
    max_transaction_records=8,
    max_transaction_bytes=8 * 64 * 1024,
)


async def test_claims_and_completions_fit_small_transaction_limits():
    store, _, _ = make_store(limits=SMALL_LIMITS)
    for i in range(20):
        await store.create_run(trigger_plan(f"run_{i}"))
    results = await store.claim([claim(f"run_{i}", f"tok_{i}") for i in range(20)])
    assert all(result.claimed for result in results)
    done = await store.complete([CompletionRequest(f"run_{i}", succeed(), f"tok_{i}") for i in range(20)])
    assert all(isinstance(result, AppendResult) for result in done)


async def test_batcher_combines_concurrent_submissions_into_one_flush():
    calls: list[list[int]] = []

    async def flush(requests: list[int]):
        calls.append(list(requests))
        await asyncio.sleep(0)
        return [ValueError(f"odd {r}") if r % 2 else r * 10 for r in requests]

    batcher: Batcher[int, int] = Batcher(flush)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(8)), return_exceptions=True)
    assert calls == [list(range(8))]
    assert results[0::2] == [0, 20, 40, 60]
    assert all(
        isinstance(error, ValueError) and str(error) == f"odd {i}" for i, error in zip(range(1, 8, 2), results[1::2])
    )


async def test_batcher_groups_submissions_made_while_a_flush_is_in_flight():
    calls: list[list[int]] = []
    gate = asyncio.Event()

    async def flush(requests: list[int]):
        calls.append(list(requests))
        if len(calls) == 1:
            await gate.wait()
        return requests

    batcher: Batcher[int, int] = Batcher(flush)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 5)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(first, *later) == [0, 1, 2, 3, 4]
    assert calls == [[0], [1, 2, 3, 4]]
    assert batcher.pending == 0
    # The batcher keeps working after going idle.
    assert await batcher.submit(9) == 9


async def test_batcher_sends_a_flush_failure_to_every_caller_of_the_batch():
    async def flush(requests):
        raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "down")

    batcher = Batcher(flush)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(result, RunlaneError) and result.code is ErrorCode.STORAGE_UNAVAILABLE for result in results)


async def test_batcher_splits_a_batch_that_exceeds_storage_limits():
    driver = local_storage_driver(clock=ControlledClock(T0), limits=SMALL_LIMITS)
    sizes: list[int] = []

    async def flush(names: list[str]):
        sizes.append(len(names))

        async def body(tx):
            await tx.now()
            for name in names:
                size = 100 * 1024 if name == "huge" else 10
                tx.create(
                    NewStorageRecord(StorageRecordKey("items", name), StorageDocument.encode({"pad": "x" * size}))
                )
            return [f"stored {name}" for name in names]

        return await driver.with_transaction(body)

    batcher: Batcher[str, str] = Batcher(flush)
    names = [f"item_{i}" for i in range(11)] + ["huge"]
    results = await asyncio.gather(*(batcher.submit(name) for name in names), return_exceptions=True)
    assert sizes[0] == 12  # one combined attempt first, then halves
    assert results[:11] == [f"stored item_{i}" for i in range(11)]
    assert isinstance(results[11], StorageLimitError)
    stored = await driver.get([StorageRecordKey("items", name) for name in names])
    assert [record is not None for record in stored] == [True] * 11 + [False]


async def test_batcher_over_store_claims_and_completions():
    store, _, driver = make_store(queue_limits={"q": 5})
    for i in range(8):
        await store.create_run(CreateRunPlan(created_event(f"run_{i}", T0)))
    claims: Batcher = Batcher(store.claim)
    completions: Batcher = Batcher(store.complete)
    before = driver.transactions
    claimed = await asyncio.gather(*(claims.submit(claim(f"run_{i}", f"tok_{i}")) for i in range(8)))
    assert driver.transactions == before + 1
    assert sum(result.claimed for result in claimed) == 5
    winners = [result for result in claimed if result.claimed]
    done = await asyncio.gather(
        *(completions.submit(CompletionRequest(r.run_id, succeed(), r.run.lease.token, known=r.run)) for r in winners)
    )
    assert driver.transactions == before + 2
    assert all(result.run.status is RunStatus.SUCCEEDED for result in done)
    assert await raw(store, queue_capacity_key(ENV_KEY, "q", None)) is None


async def test_store_batches_split_when_a_chunk_exceeds_the_transaction_limits():
    # Each run document carries a ~25 KB payload: one claim fits in 64 KiB, three do not.
    limits = StorageLimits(max_record_bytes=64 * 1024, max_transaction_bytes=64 * 1024)
    store, _, driver = make_store(limits=limits)
    for i in range(10):
        plan = trigger_plan(f"run_{i}")
        big = plan.created.model_copy(update={"payload": {"blob": "x" * 25_000}})
        await store.create_run(CreateRunPlan(big, plan.follow_up))
    before = driver.transactions
    results = await store.claim([claim(f"run_{i}", f"tok_{i}") for i in range(10)])
    assert all(result.claimed for result in results)
    assert driver.transactions > before + 1
    done = await store.complete([CompletionRequest(f"run_{i}", succeed(), f"tok_{i}") for i in range(10)])
    assert all(isinstance(result, AppendResult) for result in done)
    for i in range(10):
        assert len(await store.list_events(f"run_{i}")) == 5


async def test_a_waiter_and_its_source_finishing_in_one_batch():
    store, _, _ = make_store()
    source = await start_run(store, "source", "tok-s")
    waiter = await start_run(store, "waiter", "tok-w")
    results = await store.complete(
        [
            CompletionRequest("waiter", release_for_run("source"), "tok-w", known=waiter),
            CompletionRequest("source", succeed(), "tok-s", known=source),
        ]
    )
    assert results[0].run.status is RunStatus.RELEASED
    assert results[1].run.status is RunStatus.SUCCEEDED and results[1].completion_waiters is True
    assert await store.has_completion_wait_marker("source") is True
    # In the other order the source is already terminal when the waiter releases.
    store, _, _ = make_store()
    source = await start_run(store, "source", "tok-s")
    waiter = await start_run(store, "waiter", "tok-w")
    results = await store.complete(
        [
            CompletionRequest("source", succeed(), "tok-s", known=source),
            CompletionRequest("waiter", release_for_run("source"), "tok-w", known=waiter),
        ]
    )
    assert results[0].completion_waiters is False
    assert results[1].run.status is RunStatus.QUEUED
    assert await store.has_completion_wait_marker("source") is False


async def test_documents_match_the_shared_table_codecs():
    from runlane.core.store import encode_run_document_fast
    from runlane.storage.tables import RunChildCounts, encode_run_document, encode_run_event_document

    store, _, _ = make_store()
    run = await start_run(store, "run_1", idempotency_key="k", singleton_key="s")
    done = await store.append("run_1", succeed({"nested": [1, 2.5, "ü", None]}), expected_lease_token=run.lease.token)
    (record,) = await store.driver.get([run_key(ENV_KEY, "run_1")])
    assert record.document == encode_run_document(done.run, RunChildCounts(events=5))
    assert encode_run_document_fast(done.run, RunChildCounts(events=5)) == encode_run_document(
        done.run, RunChildCounts(events=5)
    )
    for event in await store.list_events("run_1"):
        (stored,) = await store.driver.get([StorageRecordKey("run_events", ENV_KEY, "run_1", f"{event.sequence:020d}")])
        assert stored.document == encode_run_event_document(event)
