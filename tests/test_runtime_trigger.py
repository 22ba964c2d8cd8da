"""Runtime construction (drift checks, lifecycle) and ``trigger()`` with every option."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, SecretStr, field_validator, model_validator

from runlane import (
    Actor,
    ActorType,
    ErrorCode,
    RunlaneError,
    RunSourceType,
    RunStatus,
    StorageConflictKind,
    TaskContext,
    TriggerOutcomeType,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    schedule,
    task,
)
from runlane.ids import time_ordered_uuid_hex
from runlane.testing import ControlledClock
from runlane_local import local_lane

from runtime_support import DEFAULT_QUEUE, all_runs, event_types, make_runtime, shared_runtimes


class Welcome(BaseModel):
    user_id: str


emails = queue("emails", default=True)
bounded = queue("bounded", concurrency_limit=2)


@task("emails.welcome", queue=emails)
async def welcome(payload: Welcome) -> None:
    return None


@task("emails.keyed", queue=emails, idempotency_key=lambda p: f"welcome.{p.user_id}")
async def keyed(payload: Welcome) -> None:
    return None


@task("emails.singleton", queue=emails, singleton_key=lambda p: f"user_{p.user_id}")
async def singleton(payload: Welcome) -> None:
    return None


@task("bounded.work", queue=bounded, concurrency_key=lambda p: p["tenant"])
async def bounded_work(payload: dict) -> None:
    return None


@task("no.payload", queue=emails)
async def no_payload() -> None:
    return None


# ---------------------------------------------------------------------------------------------
# create_runlane


def test_create_runlane_registers_tasks_by_id_or_by_catalog_name():
    by_id = create_runlane(lane=local_lane(), queues=[emails], tasks=[welcome, keyed])
    assert set(by_id.tasks) == {"emails.welcome", "emails.keyed"}
    assert by_id.tasks["emails.welcome"] is welcome
    catalog = create_runlane(lane=local_lane(), queues=[emails], tasks={"send_welcome": welcome})
    assert catalog.tasks.send_welcome is welcome
    assert list(catalog.queues) == ["emails"]
    assert catalog.environment.name == "default"
    with pytest.raises(AttributeError):
        getattr(catalog.tasks, "other")
    with pytest.raises(AttributeError):
        catalog.tasks.send_welcome = keyed  # type: ignore[misc]


@pytest.mark.parametrize(
    "queues, tasks, fragment",
    [
        ([emails, queue("emails")], [], "registered twice"),
        ([emails, queue("other", default=True)], [], "both marked default"),
        ([queue("other")], [welcome], "not registered"),
        ([queue("emails", default=True, concurrency_limit=3)], [welcome], "differs"),
        ([], [], "at least one queue"),
        (
            [queue("other")],
            [task("loose", schedule=schedule("loose.every", every="1m"))(lambda: None)],
            "no queue to run on",
        ),
        ([emails, queue("other")], [task("s", schedule=schedule("s.every", every="1m", queue=queue("nope")))(lambda: None)], "not registered"),
    ],
)
def test_create_runlane_rejects_queue_drift(queues, tasks, fragment):
    with pytest.raises(RunlaneError) as raised:
        create_runlane(lane=local_lane(), queues=queues, tasks=tasks)
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert fragment in raised.value.message


async def test_without_a_default_queue_a_task_without_a_queue_runs_where_each_call_says():
    billing = queue("billing")

    @task("invoices.sync")
    async def sync(payload: dict) -> str:
        return "synced"

    runtime = create_runlane(lane=local_lane(), queues=[billing], tasks=[sync])
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(sync, {})
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert "pass queue= to this call" in raised.value.message
        with pytest.raises(RunlaneError):
            await runtime.run_now(sync, {})
        assert (await runtime.runs.list()).data == []  # nothing was written
        run = (await runtime.trigger(sync, {}, queue=billing)).run
        assert run.queue == "billing"
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert (await runtime.run_now(sync, {}, queue="billing")).output == "synced"


def test_create_runlane_rejects_duplicate_task_ids_and_bad_options():
    @task("emails.welcome", queue=emails)
    async def impostor(payload: Welcome) -> None:
        return None

    with pytest.raises(RunlaneError, match="unique"):
        create_runlane(lane=local_lane(), queues=[emails], tasks=[welcome, impostor])
    # The same definition listed twice is one registration.
    assert len(create_runlane(lane=local_lane(), queues=[emails], tasks=[welcome, welcome]).tasks) == 1
    for options in (
        {"lane": "local"},
        {"clock": object()},
        {"observers": [1]},
        {"on_observer_error": 3},
        {"worker_id": "a:b"},
        {"environment": ""},
        {"dispatch": "sometimes"},
    ):
        arguments = {"lane": local_lane(), "queues": [emails], "tasks": [welcome], **options}
        with pytest.raises(RunlaneError) as raised:
            create_runlane(**arguments)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID, options
        assert "pydantic" not in raised.value.message and "\n" not in raised.value.message, raised.value.message


def test_concurrency_key_on_an_unbounded_task_queue_is_rejected():
    @task("unbounded.keyed", queue=emails, concurrency_key="k")
    async def handler() -> None:
        return None

    with pytest.raises(RunlaneError, match="concurrency_limit"):
        create_runlane(lane=local_lane(), queues=[emails], tasks=[handler])


async def test_closed_runtime_rejects_every_call_with_a_clear_error():
    runtime, _ = make_runtime(welcome, queues=[emails])
    async with runtime:
        await runtime.trigger(welcome, {"user_id": "u"})
    assert runtime.closed
    for call in (
        lambda: runtime.trigger(welcome, {"user_id": "u"}),
        lambda: runtime.execute_next(),
        lambda: runtime.tick(),
        lambda: runtime.runs.get("run_1"),
        lambda: runtime.signals.send("key"),
        lambda: runtime.start(),
    ):
        with pytest.raises(RunlaneError) as raised:
            await call()
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert "closed" in raised.value.message
    with pytest.raises(RunlaneError, match="closed"):
        runtime.worker()
    await runtime.close()  # closing twice is harmless


async def test_calls_before_start_start_the_lane_lazily():
    runtime, _ = make_runtime(welcome, queues=[emails])
    result = await runtime.trigger(welcome, {"user_id": "u"})
    assert result.outcome is TriggerOutcomeType.CREATED
    await runtime.close()


# ---------------------------------------------------------------------------------------------
# trigger


async def test_trigger_on_an_unbounded_queue_creates_and_requests_delivery():
    runtime, clock = make_runtime(welcome, queues=[emails])
    async with runtime:
        result = await runtime.trigger(welcome, {"user_id": "user_123"})
        run = result.run
        assert result.outcome is TriggerOutcomeType.CREATED
        assert run.status is RunStatus.QUEUED
        assert run.payload == {"user_id": "user_123"}
        assert run.queue == "emails"
        assert run.created_at == clock.now()
        assert run.id.startswith("run_")
        assert await event_types(runtime, run.id) == ["run.created", "run.delivery_requested"]
        assert await runtime.runs.get(run.id) == run


async def test_generated_run_ids_are_version_7_uuids_in_trigger_order():
    """``run_`` + a version-7 UUID: its first 48 bits are the Unix milliseconds when it was drawn, so
    runs triggered later sort after earlier ones (storage indexes keyed by run grow at one end)."""
    runtime, _ = make_runtime(welcome, queues=[emails])
    async with runtime:
        ids, drawn_at = [], []
        for n in range(3):
            before = time.time_ns() // 1_000_000
            ids.append((await runtime.trigger(welcome, {"user_id": f"user_{n}"})).run.id)
            drawn_at.append((before, time.time_ns() // 1_000_000))
            await asyncio.sleep(0.002)
    assert ids == sorted(ids) and len(set(ids)) == 3
    for run_id, (before, after) in zip(ids, drawn_at):
        assert re.fullmatch(r"run_[0-9a-f]{32}", run_id), run_id
        drawn = uuid.UUID(run_id.removeprefix("run_"))
        assert drawn.version == 7 and drawn.variant == uuid.RFC_4122
        assert before <= drawn.int >> 80 <= after
    many = [time_ordered_uuid_hex() for _ in range(20_000)]  # many share a millisecond: they still increase
    assert all(earlier < later for earlier, later in zip(many, many[1:]))


async def test_runs_due_at_one_instant_run_and_list_in_trigger_order():
    # A frozen clock gives every run the same creation and due time: the ids keep the trigger order.
    runtime, _ = make_runtime(welcome, queues=[emails])
    async with runtime:
        ids = [(await runtime.trigger(welcome, {"user_id": f"user_{n}"})).run.id for n in range(50)]
        listed = [run.id for run in (await runtime.runs.list(sort_direction="asc", limit=100)).data]
        executed = [(await runtime.execute_next()).id for _ in range(50)]  # type: ignore[union-attr]
    assert listed == ids and executed == ids


async def test_a_payload_model_with_field_aliases_is_stored_as_sent_and_runs():
    from pydantic import ConfigDict, Field
    from pydantic.alias_generators import to_camel

    class Signup(BaseModel):
        user_id: str = Field(alias="userId")

    class Invoice(BaseModel):  # camelCase on the wire for every field
        model_config = ConfigDict(alias_generator=to_camel)
        invoice_id: str
        amount_cents: int

    received: list[BaseModel] = []

    @task("signups.aliased", queue=emails, schema=Signup)
    async def signup(payload: Signup) -> str:
        received.append(payload)
        return payload.user_id

    @task("invoices.aliased", queue=emails, schema=Invoice)
    async def invoice(payload: Invoice) -> None:
        received.append(payload)

    runtime, _ = make_runtime(signup, invoice, queues=[emails])
    async with runtime:
        run = (await runtime.trigger(signup, {"userId": "u1"})).run
        assert run.payload == {"userId": "u1"}
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == "u1"
        now = await runtime.run_now(invoice, {"invoiceId": "in_1", "amountCents": 1200})
        assert now.status is RunStatus.SUCCEEDED and now.payload == {"invoiceId": "in_1", "amountCents": 1200}
    assert received == [Signup(userId="u1"), Invoice(invoiceId="in_1", amountCents=1200)]


async def test_trigger_on_a_bounded_queue_only_creates():
    runtime, _ = make_runtime(bounded_work, queues=[DEFAULT_QUEUE, bounded])
    async with runtime:
        run = (await runtime.trigger(bounded_work, {"tenant": "t1"})).run
        assert run.status is RunStatus.QUEUED
        assert run.concurrency_key == "t1"
        assert await event_types(runtime, run.id) == ["run.created"]


async def test_trigger_records_every_option():
    other = queue("other")
    runtime, _ = make_runtime(welcome, bounded_work, queues=[emails, other, bounded])
    async with runtime:
        actor = Actor(type=ActorType.OPERATOR, id="ops@example.com")
        result = await runtime.trigger(
            welcome,
            {"user_id": "u1"},
            actor=actor,
            idempotency_key="idem_1",
            idempotency_key_ttl="1h",
            meta={"source": "test"},
            queue=other,
            run_id="run_custom",
            singleton_key="single_1",
            trace_carrier={"traceparent": "00-abc"},
        )
        run = result.run
        assert run.id == "run_custom"
        assert run.queue == "other"
        assert run.idempotency_key == "idem_1"
        assert run.singleton_key == "single_1"
        assert run.meta == {"source": "test"}
        assert run.trace_carrier == {"traceparent": "00-abc"}
        page = await runtime.runs.events(run.id, sort_by="sequence")
        created = page.data[0].event
        assert created.actor == actor
        assert created.idempotency_key_ttl == 3_600_000
        assert page.data[1].event.actor == actor
        # Queue by registered name, and an explicit concurrency key on a bounded queue.
        by_name = await runtime.trigger(bounded_work, {"tenant": "t"}, queue="bounded", concurrency_key="override")
        assert by_name.run.queue == "bounded"
        assert by_name.run.concurrency_key == "override"


async def test_trigger_by_task_id_and_a_no_payload_task():
    runtime, _ = make_runtime(welcome, no_payload, queues=[emails])
    async with runtime:
        run = (await runtime.trigger("emails.welcome", {"user_id": "u"})).run
        assert run.task_id == "emails.welcome"
        empty = (await runtime.trigger(no_payload)).run
        assert empty.payload is None
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(no_payload, {"unexpected": True})
        assert raised.value.code is ErrorCode.VALIDATION_FAILED


async def test_idempotency_returns_the_existing_run_without_writing():
    runtime, _ = make_runtime(keyed, queues=[emails])
    async with runtime:
        first = await runtime.trigger(keyed, {"user_id": "u1"})
        again = await runtime.trigger(keyed, {"user_id": "u1"})
        assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING
        assert again.run.id == first.run.id
        assert await event_types(runtime, first.run.id) == ["run.created", "run.delivery_requested"]
        assert len(await all_runs(runtime)) == 1
        # An explicit key overrides the task's resolver.
        other = await runtime.trigger(keyed, {"user_id": "u1"}, idempotency_key="explicit")
        assert other.outcome is TriggerOutcomeType.CREATED


async def test_idempotency_retention_after_terminal_states():
    @task("retained", queue=emails, idempotency_key="same")
    async def retained() -> None:
        return None

    @task("failing", queue=emails, idempotency_key="same")
    async def failing() -> None:
        raise RuntimeError("boom")

    @task("active_only", queue=emails, idempotency_key="same", idempotency_key_ttl="active")
    async def active_only() -> None:
        return None

    runtime, clock = make_runtime(retained, failing, active_only, queues=[emails])
    async with runtime:
        first = await runtime.run_now(retained)
        assert first.status is RunStatus.SUCCEEDED
        # A succeeded owner is retained for the ttl (default 30d) ...
        assert (await runtime.trigger(retained)).run.id == first.id
        clock.advance("30d")
        # ... and released once it expires.
        assert (await runtime.trigger(retained)).outcome is TriggerOutcomeType.CREATED
        # A failed owner releases its key at once.
        failed = await runtime.run_now(failing)
        assert failed.status is RunStatus.FAILED
        assert (await runtime.trigger(failing)).run.id != failed.id
        # ttl "active" releases at any terminal state.
        done = await runtime.run_now(active_only)
        assert done.status is RunStatus.SUCCEEDED
        assert (await runtime.trigger(active_only)).run.id != done.id


async def test_idempotency_key_reset_clears_only_terminal_owners():
    runtime, _ = make_runtime(keyed, queues=[emails])
    async with runtime:
        first = (await runtime.trigger(keyed, {"user_id": "u"})).run
        with pytest.raises(RunlaneError) as raised:
            await runtime.idempotency_keys.reset(keyed, key="welcome.u")
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        await runtime.execute_next()
        assert (await runtime.runs.find_current(task=keyed, idempotency_key="welcome.u")).id == first.id
        await runtime.idempotency_keys.reset(keyed, key="welcome.u")
        assert await runtime.runs.find_current(task=keyed, idempotency_key="welcome.u") is None
        assert (await runtime.trigger(keyed, {"user_id": "u"})).run.id != first.id


async def test_a_reset_racing_a_trigger_never_clears_the_key_of_the_run_that_trigger_created():
    runtime, _ = make_runtime(keyed, queues=[emails])
    async with runtime:
        for n in range(20):
            key = f"welcome.race{n}"
            reset, first = await asyncio.gather(
                runtime.idempotency_keys.reset(keyed, key=key),
                runtime.trigger(keyed, {"user_id": f"race{n}"}, idempotency_key=key),
                return_exceptions=True,
            )
            assert reset is None or isinstance(reset, RunlaneError)  # ran before the trigger, or refused
            again = await runtime.trigger(keyed, {"user_id": f"race{n}"}, idempotency_key=key)
            assert again.outcome == "returned_existing" and again.run.id == first.run.id
            assert len((await runtime.runs.list(idempotency_key=key)).data) == 1


async def test_singleton_conflict_rejects_until_the_holder_is_terminal():
    runtime, _ = make_runtime(singleton, queues=[emails])
    async with runtime:
        holder = (await runtime.trigger(singleton, {"user_id": "u1"})).run
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(singleton, {"user_id": "u1"})
        assert raised.value.code is ErrorCode.STORAGE_CONFLICT
        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.SINGLETON_KEY
        assert len(await all_runs(runtime)) == 1
        assert (await runtime.runs.find_active(task=singleton, singleton_key="user_u1")).id == holder.id
        # Another resource is free.
        await runtime.trigger(singleton, {"user_id": "u2"})
        await runtime.runs.cancel(holder.id)
        assert (await runtime.trigger(singleton, {"user_id": "u1"})).outcome is TriggerOutcomeType.CREATED


async def test_child_runs_record_their_source():
    @task("parent", queue=emails)
    async def parent(payload: dict, ctx) -> None:
        await ctx.trigger(welcome, {"user_id": "child"})
        await ctx.trigger(welcome, {"user_id": "child2"}, trace_carrier={"traceparent": "own"})

    runtime, _ = make_runtime(parent, welcome, queues=[emails])
    async with runtime:
        run = (await runtime.trigger(parent, {}, trace_carrier={"traceparent": "parent"})).run
        await runtime.execute_next()
        page = await runtime.runs.list(source_run_id=run.id)
        children = {summary.id: summary for summary in page.data}
        assert len(children) == 2
        for summary in page.data:
            assert summary.source.type is RunSourceType.TRIGGER
            assert summary.source.source_run_id == run.id
        carriers = sorted([(await runtime.runs.get(run_id)).trace_carrier["traceparent"] for run_id in children])
        assert carriers == ["own", "parent"]


async def test_a_handler_reads_a_run_with_ctx_get_run_awaited_or_blocking():
    seen: dict[str, object] = {}

    @task("reader.async", queue=emails)
    async def reads(payload: dict, ctx) -> None:
        seen["async"] = await ctx.get_run(payload["run_id"])
        seen["missing"] = await ctx.get_run("run_missing")
        with pytest.raises(RunlaneError) as invalid:
            ctx.get_run("bad:id")
        seen["invalid"] = invalid.value.code

    @task("reader.def", queue=emails)
    def reads_blocking(payload: dict, ctx) -> None:
        seen["def"] = ctx.get_run(payload["run_id"])

    runtime, _ = make_runtime(reads, reads_blocking, welcome, queues=[emails])
    async with runtime:
        done = await runtime.run_now(welcome, {"user_id": "u"})
        for reader in (reads, reads_blocking):
            assert (await runtime.run_now(reader, {"run_id": done.id})).status is RunStatus.SUCCEEDED
    assert seen["async"] == done and seen["def"] == done
    assert seen["missing"] is None and seen["invalid"] is ErrorCode.VALIDATION_FAILED


async def test_a_controlled_clock_controls_storage_time():
    clock = ControlledClock()
    runtime = create_runlane(lane=local_lane(), queues=[emails], tasks=[welcome], clock=clock)
    # Handed over through the driver's public use_clock(), the same clock object storage samples.
    assert runtime.lane.storage.clock is clock
    async with runtime:
        clock.advance("1h")
        run = (await runtime.trigger(welcome, {"user_id": "u"})).run
        assert run.created_at == clock.now()
        done = await runtime.execute_next()
        assert done.finished_at == clock.now()


async def test_rerun_and_manual_retry_create_linked_runs_from_terminal_sources():
    @task("linked.work", idempotency_key="once", singleton_key=lambda p: f"res_{p['n']}")
    async def linked(payload: dict) -> None:
        if payload.get("fail"):
            raise RuntimeError("boom")

    runtime, _ = make_runtime(linked, queues=[emails])
    async with runtime:
        ok = await runtime.run_now(linked, {"n": 1}, trace_carrier={"traceparent": "src"})
        rerun = await runtime.runs.rerun(ok.id, meta={"why": "replay"})
        assert rerun.status is RunStatus.QUEUED and rerun.payload == {"n": 1}
        assert (rerun.source.type, rerun.source.source_run_id) == (RunSourceType.RERUN, ok.id)
        assert rerun.idempotency_key is None and rerun.singleton_key == "res_1"
        assert rerun.trace_carrier == {"traceparent": "src"} and rerun.meta == {"why": "replay"}
        created = (await runtime.runs.events(rerun.id, sort_by="sequence")).data[0].event
        assert created.actor.type is ActorType.OPERATOR
        # The singleton still applies to linked runs while the rerun is active.
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.rerun(ok.id)
        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.SINGLETON_KEY
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.rerun(rerun.id)  # not terminal
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.retry(ok.id)  # not failed
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        await runtime.runs.cancel(rerun.id)

        failed = await runtime.run_now(linked, {"n": 2, "fail": True}, idempotency_key="other")
        assert failed.status is RunStatus.FAILED
        retried = await runtime.runs.retry(failed.id, run_id="run_retry_1")
        assert retried.id == "run_retry_1" and retried.source.type is RunSourceType.MANUAL_RETRY
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.retry("run_missing")
        assert raised.value.code is ErrorCode.RUN_NOT_FOUND


# ---------------------------------------------------------------------------------------------
# Payloads that do not survive storage


class Signup(BaseModel):  # camelCase in, snake_case inside: stored as user_id, which it cannot read
    user_id: str = Field(validation_alias="userId")


class Credentials(BaseModel):
    account: str
    api_token: SecretStr  # dumped as "**********"


class Job(BaseModel):
    name: str
    priority: int = Field(default=0, exclude=True)  # left out of what is stored


class Tagged(BaseModel):
    tags: list[str]

    @model_validator(mode="after")
    def add_default_tag(self) -> Tagged:  # not idempotent: every validation appends again
        self.tags.append("runlane")
        return self


class Stamp(BaseModel):  # reads epoch seconds, and is stored as an ISO string it cannot read
    at: datetime

    @field_validator("at", mode="before")
    @classmethod
    def from_epoch(cls, value: object) -> object:
        return value if isinstance(value, datetime) else datetime.fromtimestamp(value, UTC)


class Event(BaseModel):
    event_id: str


class SignupEvent(Event):  # stored as the schema's Event: without its email
    email: str


class Line(BaseModel):
    qty: PositiveInt


class Refund(BaseModel):
    model_config = ConfigDict(strict=True)
    order_id: uuid.UUID
    requested_at: datetime
    amount: Decimal


class Report(BaseModel):
    user_id: str = Field(validation_alias="userId")


@pytest.mark.parametrize(
    ("schema", "payload", "detail"),
    [
        (Signup, {"userId": "u1"}, "userId: Field required"),
        (Credentials, {"account": "acme", "api_token": "sk_live_123"}, "gives another value"),
        (Job, {"name": "x", "priority": 9}, "gives another value"),
        (Tagged, {"tags": ["a"]}, "gives another value"),
        (Stamp, {"at": 1_700_000_000}, "raises TypeError"),
        (Event, SignupEvent(event_id="e1", email="a@b.c"), "gives the schema's Event, not the SignupEvent"),
    ],
    ids=[
        "validation-alias",
        "secret",
        "excluded-field",
        "non-idempotent-validator",
        "validator-raising-type-error",
        "subclass-instance",
    ],
)
async def test_a_payload_whose_stored_json_does_not_validate_back_is_refused_before_any_write(schema, payload, detail):
    @task("payloads.lossy", queue=emails, schema=schema)
    async def lossy(payload) -> None:
        return None

    runtime, _ = make_runtime(lossy, queues=[emails])
    async with runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(lossy, payload)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        assert "does not survive storage" in caught.value.message and detail in caught.value.message
        with pytest.raises(RunlaneError) as inline:
            await runtime.run_now(lossy, payload)
        assert inline.value.code is ErrorCode.VALIDATION_FAILED
        assert await all_runs(runtime) == []


async def test_a_model_instance_changed_after_validation_is_refused():
    @task("payloads.line", queue=emails)
    async def line(payload: Line) -> None:
        return None

    changed = Line(qty=1)
    changed.qty = -5
    runtime, _ = make_runtime(line, queues=[emails])
    async with runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(line, changed)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        assert caught.value.meta["errors"][0]["loc"] == ["qty"]
        assert await all_runs(runtime) == []


async def test_a_strict_model_takes_plain_json_data_as_the_worker_reads_it_back():
    received: list[Refund] = []

    @task("payloads.refund", queue=emails)
    async def refund(payload: Refund) -> None:
        received.append(payload)

    body = {
        "order_id": "12345678-1234-5678-1234-567812345678",
        "requested_at": "2024-03-01T10:00:00Z",
        "amount": "1.10",
    }
    runtime, _ = make_runtime(refund, queues=[emails])
    async with runtime:
        result = await runtime.trigger(refund, body)
        assert result.run.payload == body
        run = await runtime.execute_next()
        assert run.status is RunStatus.SUCCEEDED
        assert received == [
            Refund(
                order_id=uuid.UUID(body["order_id"]),
                requested_at=datetime(2024, 3, 1, 10, tzinfo=UTC),
                amount=Decimal("1.10"),
            )
        ]
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(refund, {**body, "amount": "lots"})
        assert caught.value.code is ErrorCode.VALIDATION_FAILED and caught.value.meta["errors"][0]["loc"] == ["amount"]


def test_a_schedule_payload_that_does_not_survive_storage_is_refused_when_the_task_is_defined():
    with pytest.raises(RunlaneError) as caught:

        @task("payloads.report", schedule=schedule("reports.hourly", every="1h", payload={"userId": "u"}))
        async def report(payload: Report) -> None:
            return None

    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.message.startswith("Schedule 'reports.hourly': ")
    assert caught.value.meta["schedule_id"] == "reports.hourly"


async def test_an_untyped_payload_takes_json_arrays_as_tuples_and_refuses_values_json_cannot_hold():
    received: list[dict] = []

    @task("payloads.untyped", queue=emails)
    async def untyped(payload: dict) -> None:
        received.append(payload)

    runtime, _ = make_runtime(untyped, queues=[emails])
    async with runtime:
        await runtime.trigger(untyped, {"ids": (1, 2), "nested": [("a", {"b": (3,)})]})
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert received == [{"ids": [1, 2], "nested": [["a", {"b": [3]}]]}]  # arrays, as json.dumps writes them
        for payload in ({"at": datetime(2024, 3, 1, tzinfo=UTC)}, {1: "not a string key"}):
            with pytest.raises(RunlaneError) as caught:
                await runtime.trigger(untyped, payload)  # the handler would get a str: type the field instead
            assert caught.value.code is ErrorCode.VALIDATION_FAILED
            assert "does not survive storage" in caught.value.message
        assert len(await all_runs(runtime)) == 1


class Batch(BaseModel):
    ids: Any
    extra: dict[str, Any] = {}


async def test_a_tuple_under_an_untyped_field_of_a_model_is_stored_as_an_array_as_in_an_untyped_payload():
    received: list[Batch] = []

    @task("payloads.batch", queue=emails)
    async def batch(payload: Batch) -> None:
        received.append(payload)

    runtime, _ = make_runtime(batch, queues=[emails])
    async with runtime:
        for payload in (Batch(ids=(1, 2)), {"ids": [("a", (3,))], "extra": {"pair": (4, 5)}}):
            await runtime.trigger(batch, payload)
            assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert received == [Batch(ids=[1, 2]), Batch(ids=[["a", [3]]], extra={"pair": [4, 5]})]
        with pytest.raises(RunlaneError) as caught:  # a value JSON reads back as another one still is refused
            await runtime.trigger(batch, {"ids": (datetime(2024, 3, 1, tzinfo=UTC),)})
        assert "does not survive storage" in caught.value.message
        assert len(await all_runs(runtime)) == 2


async def test_a_payload_typed_with_integer_keys_is_stored_with_string_keys_and_read_back_as_integers():
    received: list[list[dict[int, float]]] = []

    @task("payloads.counts", queue=emails)
    async def counts(payload: list[dict[int, float]]) -> None:
        received.append(payload)

    runtime, _ = make_runtime(counts, queues=[emails])
    async with runtime:
        for payload in ([{1: 0.5}], [{"2": 1.5}]):  # a Python value, and JSON data as a webhook sends it
            result = await runtime.trigger(counts, payload)
            assert result.run.payload == [{str(key): value for key, value in payload[0].items()}]
            assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert received == [[{1: 0.5}], [{2: 1.5}]]


class PlainSignup(BaseModel):
    email: str


class CorporateSignup(BaseModel):  # the next deploy's schema: its validator quotes the value it refuses
    email: str

    @field_validator("email")
    @classmethod
    def corporate(cls, value: str) -> str:
        if not value.endswith("@corp.example"):
            raise ValueError(f"{value} is not a corporate address")
        return value


async def test_a_persisted_validation_failure_keeps_where_and_what_but_not_the_values():
    @task("payloads.signup", queue=emails, schema=PlainSignup)
    async def before(payload) -> None:
        return None

    @task("payloads.signup", queue=emails, schema=CorporateSignup)
    async def after(payload) -> None:
        return None

    (old, new), _ = shared_runtimes([before], [after], queues=[emails])
    async with old, new:
        run = (await old.trigger(before, {"email": "alice.private@mail.example"})).run
        failed = await new.execute_next()
        assert failed.id == run.id and failed.status is RunStatus.FAILED
        assert failed.failure.code is ErrorCode.VALIDATION_FAILED
        assert failed.failure.meta["errors"] == [{"type": "value_error", "loc": ["email"], "msg": "Value error"}]
        stored = (await new.runs.get(run.id)).model_dump_json() + str((await new.runs.events(run.id)).data)
        assert "alice.private" not in stored.replace(run.payload["email"], "")  # only in the payload itself
        # The caller of trigger() still reads the validator's own words in the message.
        with pytest.raises(RunlaneError) as caught:
            await new.trigger(after, {"email": "bob@mail.example"})
        assert "bob@mail.example is not a corporate address" in caught.value.message
        assert "bob@mail.example" not in json.dumps(caught.value.meta)


async def test_a_handler_can_trigger_a_child_to_start_later():
    @task("reminders.child")
    async def child(payload: dict) -> None:
        return None

    @task("reminders.parent")
    async def parent(payload: dict, ctx: TaskContext) -> str:
        return (await ctx.trigger(child, {}, delay="1d")).run.id

    runtime, clock = make_runtime(parent, child)
    async with runtime:
        await runtime.trigger(parent, {})
        child_id = (await runtime.execute_next()).output
        assert await runtime.execute_next() is None  # the child is not due yet
        clock.advance("1d")
        assert (await runtime.execute_next()).id == child_id
