"""Runtime integration scenarios every lane must pass, written once and run per lane.

Subclass ``LaneScenarios`` as ``Test...`` and provide the ``lanes`` fixture: a ``LaneFactory`` whose
``new()`` returns a fresh lane over fresh storage and whose ``peer()`` returns another lane over the
same storage as the last ``new()`` (another process's view). Every scenario goes through the public
runtime API, with a controlled clock handed to the storage by ``create_runlane``; one that checks what
stays stored reads it through the lane's storage driver.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from runlane import (
    ErrorCode,
    Retry,
    Runlane,
    RunlaneError,
    RunStatus,
    StorageConflictKind,
    TaskContext,
    TriggerOutcomeType,
    WorkerMode,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    schedule,
    task,
)
from runlane.core.lanes import Lane
from runlane.core.schedules import schedule_occurrence_id, schedule_occurrence_key
from runlane.durations import MAX_INSTANT
from runlane.ids import MAX_ID_LENGTH
from runlane.models import Actor, environment_key
from runlane.testing import ControlledClock
from runlane.vocabulary import ActorType

DEFAULT = queue("default", default=True)
LIMITED = queue("limited", concurrency_limit=1, dispatch_timeout="30s")


@dataclass
class LaneFactory:
    new: Callable[[], Lane]
    peer: Callable[[], Lane]


@task("child")
async def child(payload: dict) -> str:
    """A child run some scenarios trigger from a parent's handler."""
    return "child-done"


class Submission(BaseModel):
    job_id: str


class LaneScenarios:
    #: Hard limit for one scenario; nothing may hang.
    timeout_seconds: float = 60.0

    @pytest.fixture
    def lanes(self) -> LaneFactory:
        pytest.fail("Override the `lanes` fixture with a LaneFactory.")

    # -- harness ---------------------------------------------------------------------------------

    def run(self, body: Callable[[], Any]) -> None:
        asyncio.run(asyncio.wait_for(body(), self.timeout_seconds))

    def runtime(self, lane: Lane, *tasks: Any, clock: ControlledClock | None = None, **options: Any) -> tuple[Runlane, ControlledClock]:
        clock = clock or ControlledClock()
        queues = options.pop("queues", [DEFAULT, LIMITED])
        return create_runlane(lane=lane, queues=queues, tasks=list(tasks), clock=clock, **options), clock

    # -- scenarios -------------------------------------------------------------------------------

    def test_nul_and_lone_surrogates_are_rejected_in_keys_and_nul_kept_in_json_values(self, lanes: LaneFactory) -> None:
        @task("nul")
        async def nul(payload: dict) -> dict:
            return {"echo": payload["text"]}

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), nul)
            async with runtime:
                for option in ("idempotency_key", "singleton_key"):
                    with pytest.raises(RunlaneError) as raised:
                        await runtime.trigger(nul, {"text": "x"}, **{option: "tenant\x00one"})
                    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                    assert "NUL" in raised.value.message
                with pytest.raises(RunlaneError) as raised:
                    await runtime.trigger(nul, {"text": "x"}, run_id="run\x00one")
                assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                # A lone surrogate (undecodable bytes in a command line) is not text any storage can keep.
                surrogates = (("idempotency_key", "k\udcff"), ("singleton_key", "\ud800"), ("run_id", "r\udcff"))
                for option, value in surrogates:
                    with pytest.raises(RunlaneError) as raised:
                        await runtime.trigger(nul, {"text": "x"}, **{option: value})
                    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                    assert "not valid Unicode text" in raised.value.message
                with pytest.raises(RunlaneError) as raised:
                    await runtime.idempotency_keys.reset(nul, key="k\udcff")
                assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                # A trace carrier with one was refused by storage as a driver contract breach.
                for carrier in ({"traceparent": "00-\udcff"}, {"\ud800": "1"}):
                    with pytest.raises(RunlaneError) as raised:
                        await runtime.trigger(nul, {"text": "x"}, trace_carrier=carrier)
                    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                    assert "not valid Unicode text" in raised.value.message
                assert (await runtime.runs.list(limit=10)).data == []  # nothing was written
                # Inside JSON values (payload, meta, output) a NUL is ordinary text.
                created = await runtime.trigger(nul, {"text": "a\x00b"}, meta={"note": "c\x00d"})
                done = await runtime.execute_next()
                assert done is not None and done.id == created.run.id and done.status is RunStatus.SUCCEEDED
                stored = await runtime.runs.get(created.run.id)
                assert stored.payload == {"text": "a\x00b"} and stored.meta == {"note": "c\x00d"}
                assert stored.output == {"echo": "a\x00b"}

        self.run(body)

    def test_a_cursor_with_a_position_the_lane_cannot_read_is_a_validation_error(self, lanes: LaneFactory) -> None:
        """A cursor is opaque but not secret: one edited to hold a lone surrogate or NUL (text no driver can
        send) is refused like any other malformed cursor, never a traceback or ``internal_error``."""
        from runlane.storage.cursor import decode_opaque_token, encode_opaque_token

        @task("pages")
        async def pages(payload: dict) -> None:
            return None

        def edited(cursor: str, position: str) -> str:
            token = decode_opaque_token(cursor)
            token["last"] = [position, *token["last"][1:]]
            return encode_opaque_token(token)

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), pages)
            async with runtime:
                run = (await runtime.trigger(pages, {})).run
                await runtime.trigger(pages, {})
                for sort_by in ("created_at", "updated_at", "run_at"):
                    cursor = (await runtime.runs.list(limit=1, sort_by=sort_by)).next_cursor
                    assert cursor is not None
                    for position in ("\ud800", "2026\x00"):
                        with pytest.raises(RunlaneError) as raised:
                            await runtime.runs.list(limit=1, sort_by=sort_by, cursor=edited(cursor, position))
                        assert raised.value.code is ErrorCode.VALIDATION_FAILED, raised.value.message
                events = (await runtime.runs.events(run.id, limit=1, sort_by="occurred_at")).next_cursor
                assert events is not None
                with pytest.raises(RunlaneError) as raised:
                    await runtime.runs.events(run.id, limit=1, sort_by="occurred_at", cursor=edited(events, "\udcff"))
                assert raised.value.code is ErrorCode.VALIDATION_FAILED

        self.run(body)

    def test_a_listing_filter_with_too_many_values_is_refused_and_repeats_count_once(self, lanes: LaneFactory) -> None:
        """Each filter value is a query parameter, of which a statement takes a bounded number: a listing
        by thousands of task ids is refused up front on every lane (on Postgres it was reported as an
        outage, retried forever), and a value repeated is sent once."""

        @task("listed")
        async def listed(payload: dict) -> None:
            return None

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), listed)
            async with runtime:
                await runtime.trigger(listed, {})
                with pytest.raises(RunlaneError) as raised:
                    await runtime.runs.list(task_ids=[f"task.{n}" for n in range(70_000)])
                assert raised.value.code is ErrorCode.VALIDATION_FAILED and raised.value.meta == {"field": "task_ids"}
                page = await runtime.runs.list(task_ids=["listed"] * 70_000, statuses=["queued"] * 70_000)
                assert [summary.task_id for summary in page.data] == ["listed"]
                assert len((await runtime.runs.list(task_ids=[f"task.{n}" for n in range(999)] + ["listed"])).data) == 1

        self.run(body)

    def test_an_empty_filter_list_matches_no_run_whatever_the_filter(self, lanes: LaneFactory) -> None:
        """queues=[] was refused as validation_failed, while statuses=[] and task_ids=[] list no run: each
        empty filter now matches nothing, on every lane."""

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), child)
            async with runtime:
                await runtime.trigger(child, {})
                assert len((await runtime.runs.list(queues=[DEFAULT])).data) == 1
                for empty in ({"queues": []}, {"statuses": []}, {"task_ids": []}):
                    page = await runtime.runs.list(**empty)
                    assert (page.data, page.next_cursor) == ([], None), empty

        self.run(body)

    def test_a_wait_pending_when_the_runtime_closes_ends_saying_it_is_closed(self, lanes: LaneFactory) -> None:
        """The lane closed under runs.wait(): it said what the closed lane answered, a retryable
        storage_unavailable on Postgres (a closed pool), which it waited out until its timeout, for ever
        without one, holding up the sync facade's close() for its grace; elsewhere as if storage were down."""

        @task("unfinished")
        async def unfinished(payload: dict) -> None:
            return None

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), unfinished)
            await runtime.start()
            run = (await runtime.trigger(unfinished, {})).run  # no worker: it stays queued
            waiting = asyncio.ensure_future(runtime.runs.wait(run.id))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await runtime.close()
            with pytest.raises(RunlaneError, match="runtime is closed") as raised:
                await asyncio.wait_for(waiting, 5)
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
            assert runtime._finish_waiters == {}

        self.run(body)

    def test_a_delayed_trigger_starts_once_its_time_has_come(self, lanes: LaneFactory) -> None:
        """``trigger(..., delay=...)`` / ``run_at=``: queued with its start time until then, then run by a
        worker (unbounded queue) or dispatched by tick (bounded queue), on every lane."""
        ran: list[str] = []

        @task("reminders.send")
        async def remind(payload: dict) -> None:
            ran.append(payload["to"])

        @task("reminders.limited", queue=LIMITED)
        async def limited(payload: dict) -> None:
            ran.append(payload["to"])

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), remind, limited)
            async with runtime:
                later = (await runtime.trigger(remind, {"to": "ada"}, delay="1h")).run
                assert later.status is RunStatus.QUEUED and later.run_at == clock.now() + timedelta(hours=1)
                at = clock.now() + timedelta(minutes=30)
                bounded = (await runtime.trigger(limited, {"to": "bob"}, run_at=at)).run
                assert bounded.run_at == at
                await runtime.tick()
                assert await runtime.execute_next() is None and ran == []  # neither is due
                clock.advance("30m")
                await runtime.tick()  # reserves the bounded queue's slot for the run now due
                assert (await runtime.execute_next()).id == bounded.id
                assert await runtime.execute_next() is None and ran == ["bob"]
                clock.advance("30m")
                done = await runtime.execute_next()
                assert done.id == later.id and done.status is RunStatus.SUCCEEDED and ran == ["bob", "ada"]
                with pytest.raises(RunlaneError) as raised:
                    await runtime.trigger(remind, {"to": "x"}, delay="1h", run_at=at)
                assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                with pytest.raises(RunlaneError) as raised:
                    await runtime.trigger(remind, {"to": "x"}, run_at=datetime(2030, 1, 1))  # naive
                assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
                past = (await runtime.trigger(remind, {"to": "now"}, run_at=at)).run  # already past: at once
                assert past.status is RunStatus.QUEUED and (await runtime.execute_next()).id == past.id

        self.run(body)

    def test_data_too_large_for_the_lane_is_refused_or_fails_the_attempt(self, lanes: LaneFactory) -> None:
        blob = {"size": 0}

        @task("oversized")
        async def oversized(payload: dict) -> dict:
            return {"blob": "o" * blob["size"]}

        async def body() -> None:
            lane = lanes.new()
            blob["size"] = lane.storage.profile.limits.max_record_bytes + 1
            runtime, _ = self.runtime(lane, oversized)
            async with runtime:
                with pytest.raises(RunlaneError) as raised:
                    await runtime.trigger(oversized, {"blob": "p" * blob["size"]})
                assert raised.value.code is ErrorCode.VALIDATION_FAILED
                assert raised.value.message.startswith("Run of task 'oversized' is too large to store: ")
                assert (await runtime.runs.list(limit=10)).data == []  # nothing was written

                created = await runtime.trigger(oversized, {})
                done = await runtime.execute_next()
                assert done is not None and done.id == created.run.id and done.status is RunStatus.FAILED
                assert done.failure.code is ErrorCode.TASK_OUTPUT_INVALID
                assert done.failure.message.startswith("Task output is too large to store: ")
                events = (await runtime.runs.events(done.id, sort_by="sequence")).data
                assert [record.event.type.value for record in events][-1] == "run.failed"

        self.run(body)

    def test_a_run_trigger_accepts_can_always_be_claimed_run_and_cancelled(self, lanes: LaneFactory) -> None:
        # Near the record limit: trigger() keeps room for the lease a claim adds (a worker id of the
        # maximum length), so what it accepts never fails the workers that claim it.
        seen: list[int] = []

        @task("near.limit")
        async def near_limit(payload: dict, ctx: TaskContext) -> None:
            seen.append(len(payload["pad"]))
            if payload.get("hold"):
                await ctx.signal.wait()
            if ctx.run_id.startswith("run_fails"):
                raise RuntimeError("failed on purpose")

        async def body() -> None:
            lane = lanes.new()
            limit = lane.storage.profile.limits.max_record_bytes
            runtime, _ = self.runtime(lane, near_limit)
            async with runtime:
                low, high = 0, limit
                while low < high:  # the longest pad trigger() accepts
                    size = (low + high + 1) // 2
                    try:
                        probe = {"pad": "p" * size}
                        run = (await runtime.trigger(near_limit, probe, run_id=f"run_probe_{size:07d}")).run
                    except RunlaneError as error:
                        assert error.code is ErrorCode.VALIDATION_FAILED and "keeps free" in error.message
                        high = size - 1
                    else:
                        await runtime.runs.cancel(run.id)
                        low = size
                assert low > limit - 8192
                first = (await runtime.trigger(near_limit, {"pad": "p" * low}, run_id=f"run_first_{low:07d}")).run
                done = await runtime.execute_next(worker_id="w" * MAX_ID_LENGTH)
                assert done is not None and done.id == first.id and done.status is RunStatus.SUCCEEDED
                holding = {"pad": "p" * (low - 16), "hold": True}
                held = (await runtime.trigger(near_limit, holding, run_id="run_held")).run
                attempt = asyncio.ensure_future(runtime.execute_next(worker_id="\x01" * MAX_ID_LENGTH))
                while len(seen) < 2:
                    await asyncio.sleep(0.005)
                requested = await runtime.runs.cancel(held.id, reason="r" * 200)
                assert requested.status is RunStatus.CANCELLATION_REQUESTED
                finished = await asyncio.wait_for(attempt, 10)
                assert finished is not None and finished.status is RunStatus.CANCELLED
                assert seen == [low, low - 16]
                # The largest run trigger() accepts can be rerun and retried: the recovery run's link to
                # its source fits in the room trigger() kept, and the recovery run can be claimed too.
                operator = Actor(type=ActorType.OPERATOR, id="o" * MAX_ID_LENGTH)
                failed = (await runtime.trigger(near_limit, {"pad": "p" * low}, run_id=f"run_fails_{low:07d}")).run
                assert (await runtime.execute_next()).status is RunStatus.FAILED
                retried = await runtime.runs.retry(failed.id, actor=operator)
                rerun = await runtime.runs.rerun(first.id, actor=operator)
                for recovery in (retried, rerun):
                    done = await runtime.execute_next(worker_id="w" * MAX_ID_LENGTH)
                    assert done is not None and done.id in {retried.id, rerun.id}
                assert (await runtime.runs.get(rerun.id)).status is RunStatus.SUCCEEDED
                # What a rerun adds beyond its link (a run id of its own far longer than the source's) may
                # not fit: the error says what to shorten, not to shrink a payload the operator cannot change.
                with pytest.raises(RunlaneError) as raised:
                    await runtime.runs.rerun(first.id, run_id="\U0001f600" * MAX_ID_LENGTH, actor=operator)
                assert "give it a shorter run_id or actor id" in raised.value.message

        self.run(body)

    def test_trigger_execute_and_read_back_history(self, lanes: LaneFactory) -> None:
        @task("greet")
        async def greet(payload: dict) -> dict:
            return {"hello": payload["name"]}

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), greet)
            async with runtime:
                created = await runtime.trigger(greet, {"name": "ada"}, meta={"source": "test"})
                assert created.outcome is TriggerOutcomeType.CREATED and created.run.status is RunStatus.QUEUED
                done = await runtime.execute_next()
                assert done is not None and done.id == created.run.id
                assert done.status is RunStatus.SUCCEEDED and done.output == {"hello": "ada"}
                stored = await runtime.runs.get(created.run.id)
                assert stored == done
                events = (await runtime.runs.events(done.id, sort_by="sequence")).data
                assert [record.event.type.value for record in events] == [
                    "run.created", "run.delivery_requested", "run.lease_claimed", "run.started", "run.succeeded",
                ]  # fmt: skip
                assert [record.sequence for record in events] == [1, 2, 3, 4, 5]
                listed = (await runtime.runs.list(statuses=[RunStatus.SUCCEEDED])).data
                assert [run.id for run in listed] == [done.id]
                assert await runtime.execute_next() is None

        self.run(body)

    def test_idempotency_and_singleton_keys(self, lanes: LaneFactory) -> None:
        @task("charge")
        async def charge(payload: dict) -> None:
            return None

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), charge)
            async with runtime:
                first = await runtime.trigger(charge, {"n": 1}, idempotency_key="order-1")
                again = await runtime.trigger(charge, {"n": 2}, idempotency_key="order-1")
                assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING and again.run.id == first.run.id
                await runtime.trigger(charge, {}, singleton_key="nightly")
                with pytest.raises(RunlaneError) as raised:
                    await runtime.trigger(charge, {}, singleton_key="nightly")
                assert raised.value.code is ErrorCode.STORAGE_CONFLICT
                assert get_storage_conflict_kind(raised.value) is StorageConflictKind.SINGLETON_KEY
                assert len((await runtime.runs.list()).data) == 2

        self.run(body)

    def test_idempotency_retention_and_singleton_release_through_a_peer(self, lanes: LaneFactory) -> None:
        """The owner rules of the spec on every lane, read and written by another process's runtime: a
        finite TTL counts from the end of the run (a run queued longer than its TTL still owns the key), a
        failed run gives its key up, an ``active`` key and a singleton key stay with a released run until
        it ends, a cancelled delayed run frees its singleton key and keeps its idempotency key, and pruning
        a run drops its own key only, never the one a reset handed to a newer run."""

        @task("retained")
        async def retained(payload: dict, ctx: TaskContext) -> Any:
            if payload.get("fail"):
                raise RuntimeError("failed for good")
            if payload.get("wait") and ctx.attempt == 1:
                return ctx.release("10m")
            return payload

        def singleton_conflict(error: BaseException) -> bool:
            return isinstance(error, RunlaneError) and (
                get_storage_conflict_kind(error) is StorageConflictKind.SINGLETON_KEY
            )

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), retained)
            peer, _ = self.runtime(lanes.peer(), retained, clock=clock)
            async with runtime, peer:
                first = (await runtime.trigger(retained, {}, idempotency_key="a", idempotency_key_ttl="1h")).run
                clock.advance("2h")
                assert (await peer.trigger(retained, {}, idempotency_key="a")).run.id == first.id
                assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
                clock.advance("59m")
                assert (await peer.runs.find_current(task=retained, idempotency_key="a")).id == first.id
                assert (await peer.trigger(retained, {}, idempotency_key="a")).run.id == first.id
                clock.advance("1m")
                assert await peer.runs.find_current(task=retained, idempotency_key="a") is None
                assert (await peer.trigger(retained, {}, idempotency_key="a")).outcome is TriggerOutcomeType.CREATED

                failed = (await runtime.trigger(retained, {"fail": True}, idempotency_key="f")).run
                while await runtime.execute_next() is not None:
                    pass
                assert (await peer.runs.get(failed.id)).status is RunStatus.FAILED
                assert (await peer.trigger(retained, {}, idempotency_key="f")).outcome is TriggerOutcomeType.CREATED

                waiting = await runtime.trigger(
                    retained, {"wait": True}, idempotency_key="w", idempotency_key_ttl="active", singleton_key="w"
                )
                while await runtime.execute_next() is not None:
                    pass
                assert (await peer.runs.get(waiting.run.id)).status is RunStatus.RELEASED
                assert (await peer.trigger(retained, {}, idempotency_key="w")).run.id == waiting.run.id
                with pytest.raises(RunlaneError) as raised:
                    await peer.trigger(retained, {}, singleton_key="w")
                assert singleton_conflict(raised.value)
                clock.advance("10m")
                await peer.tick()
                assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
                assert (await peer.trigger(retained, {}, idempotency_key="w")).outcome is TriggerOutcomeType.CREATED
                assert (await peer.trigger(retained, {}, singleton_key="w")).outcome is TriggerOutcomeType.CREATED

                delayed = (await runtime.trigger(retained, {}, idempotency_key="d", singleton_key="d", delay="1d")).run
                with pytest.raises(RunlaneError) as raised:
                    await peer.trigger(retained, {}, singleton_key="d")
                assert singleton_conflict(raised.value)
                assert (await peer.runs.cancel(delayed.id)).status is RunStatus.CANCELLED
                assert (await runtime.trigger(retained, {}, idempotency_key="d")).run.id == delayed.id
                assert (await runtime.trigger(retained, {}, singleton_key="d")).outcome is TriggerOutcomeType.CREATED

                old = (await runtime.trigger(retained, {}, idempotency_key="r", idempotency_key_ttl="1000d")).run
                while await runtime.execute_next() is not None:
                    pass
                await peer.idempotency_keys.reset(retained, key="r")
                newer = (await runtime.trigger(retained, {}, idempotency_key="r")).run
                clock.advance("40d")
                assert (await peer.runs.prune(older_than="30d")).pruned >= 1
                assert await runtime.runs.get(old.id) is None
                assert (await runtime.trigger(retained, {}, idempotency_key="r")).run.id == newer.id

        self.run(body)

    def test_keys_of_the_longest_length_in_any_script_work_on_every_lane(self, lanes: LaneFactory) -> None:
        """512 characters of a script that takes 3 or 4 bytes each: an idempotency, singleton or concurrency
        key the API accepts is taken by every lane (Postgres indexes at most 2,704 bytes of a record key),
        and two such keys differing in their last character stay apart."""
        ran: list[str] = []

        @task("long.keys", queue=LIMITED)
        async def long_keys(payload: dict) -> None:
            ran.append(payload["n"])

        long_key = "\U0001f600" * (MAX_ID_LENGTH - 1)

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), long_keys)
            async with runtime:
                for n, last in (("a", "a"), ("b", "b")):
                    key = long_key + last
                    first = await runtime.trigger(
                        long_keys, {"n": n}, idempotency_key=key, singleton_key="\u4e2d" * (MAX_ID_LENGTH - 1) + last,
                        concurrency_key=key,
                    )  # fmt: skip
                    again = await runtime.trigger(long_keys, {"n": n}, idempotency_key=key)
                    assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING and again.run.id == first.run.id
                    assert first.run.concurrency_key == key  # the run keeps the key itself
                await runtime.tick()  # reserves each partition's one slot
                while await runtime.execute_next() is not None:
                    pass
                assert sorted(ran) == ["a", "b"]

        self.run(body)

    def test_a_run_with_the_longest_ascii_task_id_and_idempotency_key_can_finish_and_be_cancelled(
        self, lanes: LaneFactory
    ) -> None:
        """A task id and an idempotency key of 512 ASCII characters each are taken by trigger() on every
        lane, and so is every outcome of the run: the owner a finished run keeps until its TTL ends
        is stored as the key it was created with was (on Postgres its expiry index entry restated the
        task id and key, twice the size the trigger checked: the succeeded attempt was recorded as failed
        with task_output_invalid, giving the key up, and a cancellation was refused)."""
        task_id = "reports." + "x" * (MAX_ID_LENGTH - len("reports."))

        @task(task_id)
        async def report(payload: dict) -> dict:
            return {"done": payload["n"]}

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), report)
            async with runtime:
                key = "k" * MAX_ID_LENGTH
                done = (await runtime.trigger(report, {"n": 1}, idempotency_key=key)).run
                finished = await runtime.execute_next()
                assert finished.id == done.id and finished.status is RunStatus.SUCCEEDED, finished.failure
                again = await runtime.trigger(report, {"n": 2}, idempotency_key=key)
                assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING and again.run.id == done.id
                other = "c" * MAX_ID_LENGTH
                queued = (await runtime.trigger(report, {"n": 3}, idempotency_key=other)).run
                assert (await runtime.runs.cancel(queued.id)).status is RunStatus.CANCELLED
                assert (await runtime.runs.find_current(task=report, idempotency_key=other)).id == queued.id

        self.run(body)

    def test_trigger_with_the_id_of_an_existing_run_changes_nothing(
        self, lanes: LaneFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An explicit ``run_id`` of an existing run is a stale event sequence conflict, and nothing is
        written; retrying cannot help, so it is not retryable. So is a drawn id that collides with an
        existing run: its first attempt creates the run without reading it, loses commit validation, and
        the replay reads the run and refuses (retryable: the next call draws another id)."""

        @task("collide")
        async def collide(payload: dict) -> None:
            return None

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), collide)
            async with runtime:
                chosen = (await runtime.trigger(collide, {"n": 1}, run_id="run_chosen")).run
                with monkeypatch.context() as patch:
                    patch.setattr("runlane.core.runtime.time_ordered_uuid_hex", lambda: "0" * 32)
                    drawn = (await runtime.trigger(collide, {"n": 2})).run
                    assert drawn.id == f"run_{'0' * 32}"
                    attempts = [
                        (runtime.trigger(collide, {"n": 3}, run_id=chosen.id), False),
                        (runtime.trigger(collide, {"n": 4}, run_id=drawn.id), False),
                        (runtime.trigger(collide, {"n": 5}), True),
                    ]
                    for attempt, retryable in attempts:
                        with pytest.raises(RunlaneError) as raised:
                            await attempt
                        assert raised.value.code is ErrorCode.STORAGE_CONFLICT
                        assert raised.value.retryable is retryable
                        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.EVENT_SEQUENCE
                        assert raised.value.message.startswith("Run id run_") and "is taken by an existing" in (
                            raised.value.message
                        )
                for run in (chosen, drawn):
                    assert await runtime.runs.get(run.id) == run
                    events = (await runtime.runs.events(run.id, sort_by="sequence")).data
                    assert [record.event.type.value for record in events] == ["run.created", "run.delivery_requested"]
                assert len((await runtime.runs.list()).data) == 2

        self.run(body)

    def test_retry_with_backoff_then_success_and_attempts(self, lanes: LaneFactory) -> None:
        @task("flaky", retry=Retry(3, backoff="10s"))
        async def flaky(payload: dict, ctx: TaskContext) -> int:
            if ctx.attempt < 3:
                raise RuntimeError("temporary")
            return ctx.attempt

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), flaky)
            async with runtime:
                run = (await runtime.trigger(flaky, {})).run
                first = await runtime.execute_next()
                assert first.status is RunStatus.RETRYING and first.failure.message == "Task failed."
                assert await runtime.execute_next() is None  # not due yet
                clock.advance("10s")
                assert (await runtime.execute_next()).status is RunStatus.RETRYING
                clock.advance("1m")
                done = await runtime.execute_next()
                assert done.status is RunStatus.SUCCEEDED and done.output == 3
                attempts = await runtime.runs.attempts(run.id)
                assert [attempt.attempt for attempt in attempts] == [1, 2, 3]

        self.run(body)

    def test_delays_past_the_year_9999_wait_until_the_last_instant_and_the_worker_goes_on(
        self, lanes: LaneFactory
    ) -> None:
        # A valid duration reaches 2**53 - 1 ms (285,000 years); datetime ends with the year 9999.
        forever = "3000000d"

        @task("retry.forever", retry=Retry(2, backoff=forever))
        async def retry_forever(payload: dict) -> None:
            raise RuntimeError("down")

        @task("release.forever")
        async def release_forever(payload: dict, ctx: TaskContext) -> Any:
            return ctx.release(forever, reason="later")

        @task("wait.forever")
        async def wait_forever(payload: dict, ctx: TaskContext) -> Any:
            return ctx.wait_for_signal("approval", timeout=forever)

        @task("plain")
        async def plain(payload: dict) -> str:
            return "done"

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), retry_forever, release_forever, wait_forever, plain)
            async with runtime:
                tasks = (retry_forever, release_forever, wait_forever)
                waiting = [(await runtime.trigger(each, {})).run.id for each in tasks]
                after = (await runtime.trigger(plain, {})).run.id
                worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=2)
                await worker.closed
                runs = [await runtime.runs.get(run_id) for run_id in waiting]
                assert [run.status for run in runs] == [RunStatus.RETRYING, RunStatus.RELEASED, RunStatus.RELEASED]
                assert {run.run_at for run in runs} == {MAX_INSTANT} and all(run.lease is None for run in runs)
                assert runs[1].wait.resume_at == MAX_INSTANT and runs[2].wait.timeout_at == MAX_INSTANT
                assert (await runtime.runs.get(after)).status is RunStatus.SUCCEEDED
                assert (await runtime.tick()).delivery_requested == 0

        self.run(body)

    def test_signal_wait_and_wait_for_run(self, lanes: LaneFactory) -> None:
        @task("parent")
        async def parent(payload: dict, ctx: TaskContext) -> Any:
            if ctx.attempt == 1:
                return ctx.wait_for_signal("approved", reason="needs_approval")
            if ctx.attempt == 2:
                spawned = await ctx.trigger(child, {})
                return ctx.wait_for_run(spawned.run.id)
            return "parent-done"

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), parent, child)
            async with runtime:
                run = (await runtime.trigger(parent, {})).run
                assert (await runtime.execute_next()).status is RunStatus.RELEASED
                resumed = await runtime.signals.send("approved")
                assert [r.id for r in resumed] == [run.id]
                assert await runtime.signals.send("approved") == []
                assert (await runtime.execute_next()).status is RunStatus.RELEASED  # waits for its child
                finished = await runtime.execute_next()
                assert finished.task_id == "child" and finished.source.source_run_id == run.id
                done = await runtime.execute_next()
                assert done.id == run.id and done.status is RunStatus.SUCCEEDED and done.output == "parent-done"

        self.run(body)

    def test_runs_with_the_longest_ids_wait_for_the_longest_signal_keys_and_for_each_other(
        self, lanes: LaneFactory
    ) -> None:
        """A run id and a signal key of 512 characters each (ASCII, or of any script for the key) are taken
        by every lane when the run releases to wait, and so is a wait of such a run for another one: on
        Postgres the wait's index entry restated the run id after the key, over the lane's index entry
        limit, so the release was recorded as a failed attempt (and a key of 512 CJK characters could
        never be waited for on that lane)."""
        wide = "\u4e2d" * MAX_ID_LENGTH

        @task("approve")
        async def approve(payload: dict, ctx: TaskContext) -> Any:
            if ctx.attempt == 1:
                if "run" in payload:
                    return ctx.wait_for_run(payload["run"])
                return ctx.wait_for_signal(payload["key"])
            return "resumed"

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), approve)
            async with runtime:
                ids = {name: name[0] * MAX_ID_LENGTH for name in ("ascii", "wide", "follower")}
                await runtime.trigger(approve, {"key": "k" * MAX_ID_LENGTH}, run_id=ids["ascii"])
                await runtime.trigger(approve, {"key": wide}, run_id=ids["wide"])
                await runtime.trigger(approve, {"run": ids["ascii"]}, run_id=ids["follower"])
                for _ in ids:
                    released = await runtime.execute_next()
                    assert released.status is RunStatus.RELEASED, released.failure
                assert [run.id for run in await runtime.signals.send("k" * MAX_ID_LENGTH)] == [ids["ascii"]]
                assert [run.id for run in await runtime.signals.send(wide)] == [ids["wide"]]
                assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED  # ascii; its follower resumes
                for _ in range(2):
                    assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
                assert {(await runtime.runs.get(run_id)).output for run_id in ids.values()} == {"resumed"}

        self.run(body)

    def test_two_environments_over_one_store_keep_runs_keys_capacity_signals_waits_and_streams_apart(
        self, lanes: LaneFactory
    ) -> None:
        """Two runtimes over the same storage, in environments whose names are a prefix of each other and
        hold characters that matter in keys: the same run ids and keys, a full bounded queue, a signal, a
        completion wait, a schedule, the observation stream, trim and prune of one never reach the other."""
        hold = asyncio.Event()

        @task("env.limited", queue=LIMITED)
        async def limited(payload: dict, ctx: TaskContext) -> str:
            if payload.get("hold"):
                await asyncio.wait_for(hold.wait(), 30)
            return ctx.environment.name

        @task("env.waits")
        async def waits(payload: dict, ctx: TaskContext) -> Any:
            if ctx.attempt == 1:
                return ctx.wait_for_signal("approved") if payload["on"] == "signal" else ctx.wait_for_run("source")
            return "resumed"

        @task("env.plain", schedule=schedule("env.minutely", every="1m"))
        async def plain(payload: Any = None) -> str:
            return "plain"

        async def body() -> None:
            clock = ControlledClock()
            tasks = (limited, waits, plain)
            a, _ = self.runtime(lanes.new(), *tasks, clock=clock, environment="t:1 /%")
            b, _ = self.runtime(lanes.peer(), *tasks, clock=clock, environment="t:1 /%2")
            async with a, b:
                keys = {"idempotency_key": "k", "singleton_key": "s"}
                for runtime in (a, b):
                    created = await runtime.trigger(limited, {"hold": runtime is a}, run_id="run", **keys)
                    assert created.outcome is TriggerOutcomeType.CREATED
                # a holds its one slot of the bounded queue; b's run of the same id still runs at once.
                holding = asyncio.ensure_future(a.execute_next())
                for _ in range(2000):
                    if (await a.runs.get("run")).status is RunStatus.RUNNING:
                        break
                    await asyncio.sleep(0.001)
                assert (await a.runs.get("run")).status is RunStatus.RUNNING
                done = await b.execute_next()
                assert done is not None and done.environment.name == "t:1 /%2" and done.output == "t:1 /%2"
                assert (await b.trigger(limited, {}, idempotency_key="k")).run.id == "run"
                await b.idempotency_keys.reset(limited, key="k")
                again = await a.trigger(limited, {}, idempotency_key="k")
                assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING  # b's reset left a's owner
                hold.set()
                assert (await holding).output == "t:1 /%"

                for runtime in (a, b):
                    await runtime.trigger(waits, {"on": "signal"}, run_id="signal")
                    await runtime.trigger(waits, {"on": "run"}, run_id="completion")
                    assert (await runtime.execute_next()).status is RunStatus.RELEASED
                    assert (await runtime.execute_next()).status is RunStatus.RELEASED
                assert [run.environment.name for run in await b.signals.send("approved")] == ["t:1 /%2"]
                await b.trigger(limited, {}, run_id="source")
                assert (await b.execute_next()).id == "source"
                resumed = [await b.execute_next(), await b.execute_next()]  # completion: by b's own source run
                assert {(run.id, run.output) for run in resumed} == {("signal", "resumed"), ("completion", "resumed")}
                assert await a.execute_next() is None  # neither the signal nor b's source run resumed a's
                for run_id in ("signal", "completion"):
                    assert (await a.runs.get(run_id)).status is RunStatus.RELEASED

                assert (await b.tick()).materialized == 1
                assert (await a.runs.list(task_ids=["env.plain"])).data == []
                assert (await a.tick()).materialized == 1  # the same schedule id fires in each environment

                a_records = (await a.observations.scan(limit=500)).records
                b_records = (await b.observations.scan(limit=500)).records
                assert {record.observation.environment.name for record in a_records} == {"t:1 /%"}
                assert {record.observation.environment.name for record in b_records} == {"t:1 /%2"}
                clock.advance("2d")
                assert (await b.observations.trim(older_than="1d")).deleted == len(b_records)
                assert (await a.observations.scan(limit=500)).records == a_records
                a_runs = {summary.id for summary in (await a.runs.list(limit=100)).data}
                assert (await b.runs.prune(older_than="1d")).pruned == 4  # run, source, signal, completion
                assert {summary.id for summary in (await a.runs.list(limit=100)).data} == a_runs
                assert {"run", "signal", "completion"} <= a_runs

        self.run(body)

    def test_a_run_of_the_longest_environment_name_waits_for_the_longest_signal_key(self, lanes: LaneFactory) -> None:
        """With an environment name of 200 bytes, a run with an id as long as its trigger takes on the lane
        (400 characters) waits for a signal key of 512 characters: on Postgres a key past 256 bytes took the
        wait's index entry, which holds the run id too, past what the run's trigger had checked, over the
        lane's index entry limit, so the release was recorded as a failed attempt."""

        @task("approve")
        async def approve(payload: dict, ctx: TaskContext) -> Any:
            if ctx.attempt == 1:
                return ctx.wait_for_signal("k" * MAX_ID_LENGTH)
            return "resumed"

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), approve, environment="e" * 200)
            async with runtime:
                run = (await runtime.trigger(approve, {}, run_id="a" * 400)).run
                released = await runtime.execute_next()
                assert released.status is RunStatus.RELEASED, released.failure
                assert [resumed.id for resumed in await runtime.signals.send("k" * MAX_ID_LENGTH)] == [run.id]
                assert (await runtime.execute_next()).output == "resumed"

        self.run(body)

    def test_a_run_with_the_longest_id_triggers_and_is_rerun_as_runs_with_the_longest_ids(
        self, lanes: LaneFactory
    ) -> None:
        """A child a run with a 512-character id triggers with such an id, and a rerun given one, are linked to
        their source on every lane: on Postgres the link's index entry restated the new run's id after the
        source's, over the lane's index entry limit, so ctx.trigger() failed the parent (validation_failed)
        and the rerun was refused."""

        @task("parent")
        async def parent(payload: dict, ctx: TaskContext) -> Any:
            if ctx.attempt == 1:
                spawned = await ctx.trigger(child, {}, run_id="c" * MAX_ID_LENGTH)
                return ctx.wait_for_run(spawned.run.id)
            return (await ctx.get_run("c" * MAX_ID_LENGTH)).output

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), parent, child)
            async with runtime:
                run = await runtime.run_now(parent, {}, run_id="p" * MAX_ID_LENGTH)
                assert run.status is RunStatus.RELEASED, run.failure
                assert (await runtime.execute_next()).source.source_run_id == run.id
                done = await runtime.execute_next()
                assert done.id == run.id and done.output == "child-done", done.failure
                rerun = await runtime.runs.rerun(run.id, run_id="r" * MAX_ID_LENGTH)
                assert rerun.source.source_run_id == run.id

        self.run(body)

    def test_durable_step_replays_its_stored_output(self, lanes: LaneFactory) -> None:
        calls: list[str] = []

        @task("render")
        async def render(payload: dict, ctx: TaskContext) -> Any:
            async def submit(token: str) -> dict:
                calls.append(token)
                return {"job_id": f"job_{len(calls)}"}

            submission = await ctx.step.run("submit", submit, output=Submission)
            if ctx.attempt == 1:
                return ctx.release("30s")
            return submission.job_id

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), render)
            async with runtime:
                await runtime.trigger(render, {})
                assert (await runtime.execute_next()).status is RunStatus.RELEASED
                clock.advance("30s")
                done = await runtime.execute_next()
                assert done.status is RunStatus.SUCCEEDED and done.output == "job_1" and len(calls) == 1

        self.run(body)

    def test_steps_with_the_longest_keys_are_stored_listed_and_pruned(self, lanes: LaneFactory) -> None:
        """A step key of 512 characters of any script (and one of 512 ASCII characters in a run whose id is
        as long) is stored, replayed, listed and pruned with its run on every lane: on Postgres the step's
        record key held the key itself, over the lane's index entry limit, so the attempt failed as soon as
        its step completed (``task_output_invalid``), however often it was retried."""
        keys = ["\u4e2d" * MAX_ID_LENGTH, "s" * MAX_ID_LENGTH, "a.short.one"]
        calls: list[str] = []

        @task("stepper")
        async def stepper(payload: dict, ctx: TaskContext) -> Any:
            outputs = []
            for n, key in enumerate(keys):
                outputs.append(await ctx.step.run(key, lambda token, n=n: calls.append(token) or n))
            if ctx.attempt == 1:
                return ctx.release("1s")
            return outputs

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), stepper)
            async with runtime:
                for run_id in ("short", "r" * MAX_ID_LENGTH):
                    released = await runtime.run_now(stepper, {}, run_id=run_id)
                    assert released.status is RunStatus.RELEASED, released.failure
                    clock.advance("1s")
                    done = await runtime.execute_next()
                    assert done.status is RunStatus.SUCCEEDED and done.output == [0, 1, 2], done.failure
                    assert [(await runtime.runs.step(run_id, key)).output for key in keys] == [0, 1, 2]
                    listed, cursor = [], None
                    while True:  # a page at a time, so a long key's position is a cursor too
                        page = await runtime.runs.steps(run_id, cursor=cursor, limit=1)
                        listed.extend(step.step_key for step in page.data)
                        if (cursor := page.next_cursor) is None:
                            break
                    assert sorted(listed) == sorted(keys)
                assert len(calls) == 6  # each step's fn ran once per run
                clock.advance("2d")
                assert (await runtime.runs.prune(older_than="1d")).pruned == 2
                assert (await runtime.runs.list()).data == []

        self.run(body)

    def test_steps_run_together_are_each_stored_once(self, lanes: LaneFactory) -> None:
        # Steps gathered in one attempt each update the run's record; they must not fail one another's
        # transactions (and with them the attempt, whose retry would repeat their side effects).
        calls: list[str] = []

        @task("send.batch")
        async def send_batch(payload: dict, ctx: TaskContext) -> int:
            async def send(token: str) -> dict:
                calls.append(token)
                await asyncio.sleep(0.01)
                return {"message_id": token[-12:]}

            sent = await asyncio.gather(*(ctx.step.run(f"send.{n}", send) for n in range(payload["n"])))
            return len(sent)

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), send_batch)
            async with runtime:
                run = await runtime.run_now(send_batch, {"n": 300})
                assert run.status is RunStatus.SUCCEEDED and run.output == 300, run.failure
                assert len(calls) == len(set(calls)) == 300
                steps, cursor = [], None
                while True:
                    page = await runtime.runs.steps(run.id, cursor=cursor, limit=100)
                    steps.extend(page.data)
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                assert sorted(step.step_key for step in steps) == sorted(f"send.{n}" for n in range(300))

        self.run(body)

    def test_cancel_queued_and_running_runs(self, lanes: LaneFactory) -> None:
        started = asyncio.Event()

        @task("slow")
        async def slow(payload: dict, ctx: TaskContext) -> str:
            started.set()
            await ctx.signal.wait()
            return "stopped"

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), slow)
            async with runtime:
                queued = (await runtime.trigger(slow, {})).run
                cancelled = await runtime.runs.cancel(queued.id)
                assert cancelled.status is RunStatus.CANCELLED
                running = (await runtime.trigger(slow, {})).run
                execution = asyncio.ensure_future(runtime.execute_next())
                await asyncio.wait_for(started.wait(), 10)
                requested = await runtime.runs.cancel(running.id)
                assert requested.status is RunStatus.CANCELLATION_REQUESTED
                done = await asyncio.wait_for(execution, 10)
                assert done.status is RunStatus.CANCELLED
                with pytest.raises(RunlaneError) as raised:
                    await runtime.runs.cancel(running.id)
                assert raised.value.code is ErrorCode.VALIDATION_FAILED  # terminal runs stay as they are
                events = (await runtime.runs.events(running.id, sort_by="sequence")).data
                assert [record.event.type.value for record in events].count("run.cancellation_requested") == 1

        self.run(body)

    def test_bounded_queue_dispatch_and_capacity(self, lanes: LaneFactory) -> None:
        @task("limited.work", queue=LIMITED)
        async def limited(payload: dict) -> int:
            return payload["n"]

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), limited)
            async with runtime:
                for n in range(3):
                    await runtime.trigger(limited, {"n": n})
                assert (await runtime.tick()).dispatch_reserved == 1
                assert (await runtime.tick()).dispatch_reserved == 0  # the only slot is taken
                assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
                assert (await runtime.tick()).dispatch_reserved == 1
                assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
                assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED  # capacity is free again
                assert await runtime.execute_next() is None

        self.run(body)

    def test_a_drain_runs_the_backlog_its_own_runs_hold_capacity_against(self, lanes: LaneFactory) -> None:
        # One slot: while a drain slot runs one of them, the other slots' scans find the partition full.
        # Each finished run frees the slot again, and the drain goes on until no run is left.
        executed: list[int] = []

        @task("limited.backlog", queue=LIMITED)
        async def backlog(payload: dict) -> None:
            executed.append(payload["n"])

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), backlog)
            async with runtime:
                for n in range(40):
                    await runtime.trigger(backlog, {"n": n})
                drain = runtime.worker(mode=WorkerMode.DRAIN, concurrency=4)
                await asyncio.wait_for(drain.closed, 30)
                assert sorted(executed) == list(range(40))
                assert drain.executed == 40

        self.run(body)

    def test_schedule_materializes_once_and_prune_removes_finished_runs(self, lanes: LaneFactory) -> None:
        seen: list[Any] = []

        @task("metrics.flush", schedule=schedule("metrics.every_15m", every="15m"))
        async def flush(payload: Any) -> None:
            seen.append(payload)

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), flush)
            async with runtime:
                clock.advance("15m")
                assert (await runtime.tick()).materialized == 1
                assert (await runtime.tick()).materialized == 0  # the occurrence is claimed once
                worker = runtime.worker(mode=WorkerMode.DRAIN)
                await asyncio.wait_for(worker.closed, 10)
                assert len(seen) == 1
                clock.advance("2d")
                result = await runtime.runs.prune(older_than="1d")
                assert result.pruned == 1
                assert (await runtime.runs.list()).data == []

        self.run(body)

    def test_a_recurring_schedule_keeps_only_its_latest_occurrence_record(self, lanes: LaneFactory) -> None:
        start = datetime(2026, 1, 1, tzinfo=UTC)
        fire_times = [start + timedelta(minutes=n) for n in range(1, 6)]

        @task("metrics.rollup", schedule=schedule("metrics.minutely", every="1m", ends_at=fire_times[-1]))
        async def rollup(payload: Any) -> None:
            return None

        async def body() -> None:
            clock = ControlledClock(start)
            lane = lanes.new()
            runtime, _ = self.runtime(lane, rollup, clock=clock)
            async with runtime:
                env = environment_key(runtime.environment)
                keys = [
                    schedule_occurrence_key(env, schedule_occurrence_id(runtime.environment, "metrics.minutely", fire))
                    for fire in fire_times
                ]
                for _ in fire_times:
                    clock.advance("1m")
                    assert (await runtime.tick()).materialized == 1
                    await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN).closed, 10)
                stored = await lane.storage.get(keys)
                assert [record is not None for record in stored] == [False, False, False, False, True]
                run_ids = {run.id for run in (await runtime.runs.list()).data}
                assert len(run_ids) == 5

                # A maintenance process whose clock is behind reaches a superseded fire time again: it
                # finds that fire time's run and creates no other.
                behind, _ = self.runtime(lanes.peer(), rollup, clock=ControlledClock(fire_times[3]), worker_id="behind")
                async with behind:
                    await behind.tick()
                assert {run.id for run in (await runtime.runs.list()).data} == run_ids
                (fourth,) = [run for run in (await runtime.runs.list()).data if run.run_at == fire_times[3]]
                created = await runtime.runs.events(fourth.id, sort_by="sequence")
                assert [record.event.type.value for record in created.data].count("run.created") == 1

                # The latest occurrence outlives the pruning of its run: the schedule's last fire time
                # is not materialized again.
                clock.advance("2d")
                assert (await runtime.tick()).materialized == 0
                assert (await runtime.runs.prune(older_than="1d")).pruned == 5
                assert (await runtime.tick()).materialized == 0
                assert (await runtime.runs.list()).data == []

        self.run(body)

    def test_observation_trim_keeps_what_a_consumer_has_not_exported_and_the_stream_goes_on(
        self, lanes: LaneFactory
    ) -> None:
        @task("observed")
        async def observed(payload: Any) -> None:
            return None

        class Collect:
            def __init__(self) -> None:
                self.positions: list[int] = []

            async def export(self, records: Any) -> None:
                self.positions.extend(int(record.stream_position) for record in records)

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), observed)
            async with runtime:
                for _ in range(3):
                    await runtime.run_now(observed, {})  # four records each: positions 1-12
                sink = Collect()
                exporter = runtime.observation_exporter("audit", sink, batch_size=5)
                await exporter.export_once()  # the consumer has exported positions 1-5
                clock.advance("2d")
                await runtime.run_now(observed, {})  # positions 13-16, recent

                kept_for_audit = await runtime.observations.trim(older_than="1d", consumers=["audit"])
                assert (kept_for_audit.deleted, kept_for_audit.more) == (5, False)
                # A consumer with no checkpoint yet keeps everything.
                none_for_new = await runtime.observations.trim(older_than="1d", consumers=["audit", "new"])
                assert (none_for_new.deleted, none_for_new.more) == (0, False)
                by_limit = await runtime.observations.trim(older_than="1d", limit=4)
                assert (by_limit.deleted, by_limit.more) == (4, True)
                rest = await runtime.observations.trim(older_than="1d")
                assert (rest.deleted, rest.more) == (3, False)  # the recent run's records stay
                page = await runtime.observations.scan()
                assert [int(record.stream_position) for record in page.records] == [13, 14, 15, 16]

                # The exporter resumes after its checkpoint (position 5) with what is left; new records
                # continue the positions.
                await runtime.run_now(observed, {})
                while (await exporter.export_once()).exported:
                    pass
                assert sink.positions == [1, 2, 3, 4, 5, *range(13, 21)]

        self.run(body)

    def test_an_exporter_whose_batch_is_trimmed_while_it_is_sent_goes_on_with_the_rest(
        self, lanes: LaneFactory
    ) -> None:
        @task("observed")
        async def observed(payload: Any) -> None:
            return None

        async def body() -> None:
            runtime, clock = self.runtime(lanes.new(), observed)

            class TrimWhileSending:
                """Retention without this consumer runs while the first batch is sent."""

                def __init__(self) -> None:
                    self.positions: list[int] = []

                async def export(self, records: Any) -> None:
                    if not self.positions:
                        assert (await runtime.observations.trim(older_than="1d")).deleted == 8
                    self.positions.extend(int(record.stream_position) for record in records)

            async with runtime:
                for _ in range(2):
                    await runtime.run_now(observed, {})  # positions 1-8
                clock.advance("2d")
                await runtime.run_now(observed, {})  # positions 9-12, recent
                sink = TrimWhileSending()
                exporter = runtime.observation_exporter("late", sink, batch_size=4)

                # The batch's last record is gone, so the checkpoint cannot move there: the tick fails
                # retryably, and the exporter loop does not stop for good.
                tick = await exporter.export_once()
                assert tick.status.value == "failed" and isinstance(tick.error, RunlaneError)
                assert tick.error.retryable
                assert get_storage_conflict_kind(tick.error) is StorageConflictKind.OBSERVATION_CHECKPOINT
                assert await runtime.observations.checkpoint("late") is None

                # The next tick scans again from the checkpoint, past what was deleted.
                assert (await exporter.export_once()).exported == 4
                assert sink.positions == [1, 2, 3, 4, 9, 10, 11, 12]

        self.run(body)

    def test_drain_worker_with_concurrent_slots_runs_each_run_once(self, lanes: LaneFactory) -> None:
        executed: list[int] = []

        @task("count")
        async def count(payload: dict) -> int:
            executed.append(payload["n"])
            await asyncio.sleep(0)
            return payload["n"]

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), count)
            async with runtime:
                for n in range(40):
                    await runtime.trigger(count, {"n": n})
                worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=4)
                await asyncio.wait_for(worker.closed, 30)
                assert sorted(executed) == list(range(40))
                assert len((await runtime.runs.list(statuses=[RunStatus.SUCCEEDED], limit=100)).data) == 40

        self.run(body)

    def test_the_sync_facade_and_an_application_loop_share_a_runtime(self, lanes: LaneFactory) -> None:
        """Producer threads call ``runtime.sync`` (the facade's own loop) while the application loop
        triggers too and runs a poll worker: every run executes once and nothing waits forever."""
        executed: list[int] = []

        @task("facade")
        async def facade(payload: dict) -> int:
            executed.append(payload["n"])
            return payload["n"]

        async def body() -> None:
            runtime, _ = self.runtime(lanes.new(), facade)
            created: list[str] = []
            failures: list[BaseException] = []

            def produce(first: int) -> None:
                try:
                    for n in range(first, first + 15):
                        run_id = runtime.sync.trigger(facade, {"n": n}).run.id
                        assert runtime.sync.runs.get(run_id) is not None
                        created.append(run_id)
                except BaseException as error:  # reported by the loop below
                    failures.append(error)

            async with runtime:
                loop = asyncio.get_running_loop()
                worker = runtime.worker(concurrency=4, empty_poll_delay="5ms")
                threads = [threading.Thread(target=produce, args=(first,)) for first in (100, 200)]
                for thread in threads:
                    thread.start()
                for n in range(15):
                    created.append((await runtime.trigger(facade, {"n": n})).run.id)
                for thread in threads:
                    await asyncio.to_thread(thread.join, 30)
                assert failures == [] and len(set(created)) == 45
                deadline = loop.time() + 30
                while worker.executed < 45:
                    assert loop.time() < deadline, f"{worker.executed} of 45 runs executed"
                    await asyncio.sleep(0.005)
                await worker.stop()
                assert sorted(executed) == [*range(15), *range(100, 115), *range(200, 215)]
                for run_id in created:
                    run = await runtime.runs.get(run_id)
                    assert run is not None and run.status is RunStatus.SUCCEEDED and run.counters.attempts == 1

        self.run(body)

    def test_two_runtimes_over_one_storage_share_state_without_duplicates(self, lanes: LaneFactory) -> None:
        executed: list[tuple[str, int]] = []

        def counting(name: str) -> Any:
            @task("shared")
            async def shared(payload: dict) -> int:
                executed.append((name, payload["n"]))
                await asyncio.sleep(0)
                return payload["n"]

            return shared

        async def body() -> None:
            clock = ControlledClock()
            first_lane = lanes.new()
            second_lane = lanes.peer()
            first, _ = self.runtime(first_lane, counting("a"), clock=clock, worker_id="a")
            second, _ = self.runtime(second_lane, counting("b"), clock=clock, worker_id="b")
            async with first, second:
                ids = [(await first.trigger("shared", {"n": n})).run.id for n in range(30)]
                seen = await second.runs.get(ids[0])
                assert seen is not None and seen.status is RunStatus.QUEUED
                workers = [
                    first.worker(mode=WorkerMode.DRAIN, concurrency=2),
                    second.worker(mode=WorkerMode.DRAIN, concurrency=2),
                ]
                await asyncio.wait_for(asyncio.gather(*(worker.closed for worker in workers)), 30)
                assert sorted(n for _, n in executed) == list(range(30))
                for run_id in ids:
                    run = await second.runs.get(run_id)
                    assert run.status is RunStatus.SUCCEEDED and run.counters.attempts == 1

        self.run(body)

    def test_expired_lease_is_recovered_by_tick(self, lanes: LaneFactory) -> None:
        attempts: list[int] = []

        @task("recoverable")
        async def recoverable(payload: dict, ctx: TaskContext) -> int:
            attempts.append(ctx.attempt)
            if ctx.attempt == 1:
                await asyncio.sleep(3600)  # stands in for a worker that died mid-attempt
            return ctx.attempt

        async def body() -> None:
            clock = ControlledClock()
            crashed_lane = lanes.new()
            crashed, _ = self.runtime(crashed_lane, recoverable, clock=clock, worker_id="crashed")
            survivor, _ = self.runtime(lanes.peer(), recoverable, clock=clock, worker_id="survivor")
            async with survivor:
                await crashed.__aenter__()
                run = (await crashed.trigger(recoverable, {})).run
                hung = asyncio.ensure_future(crashed.execute_next(lease_duration="30s", heartbeat_interval="20s"))
                for _ in range(1000):
                    if attempts or hung.done():
                        break
                    await asyncio.sleep(0.01)
                assert attempts == [1], hung.result() if hung.done() else "the first attempt never started"
                hung.cancel()  # the process is gone: no outcome, no heartbeat, the lease stays
                await asyncio.gather(hung, return_exceptions=True)
                assert (await survivor.runs.get(run.id)).status is RunStatus.RUNNING
                clock.advance("31s")
                result = await survivor.tick()
                assert result.delivery_requested == 1
                done = await survivor.execute_next()
                assert done.id == run.id and done.status is RunStatus.SUCCEEDED and done.output == 2
                assert done.counters.attempts == 2

        self.run(body)

    def test_waiters_of_a_run_whose_process_died_once_it_finished_are_resumed_by_tick(
        self, lanes: LaneFactory
    ) -> None:
        @task("awaited")
        async def awaited(payload: dict) -> str:
            return "source-done"

        @task("awaiting")
        async def awaiting(payload: dict, ctx: TaskContext) -> Any:
            if ctx.attempt == 1:
                return ctx.wait_for_run(payload["source"])
            return "resumed"

        gone = asyncio.Event()

        async def stalls_on_the_finished_source(observation: Any) -> None:
            # Its commit stands; the process goes away before it resumes the waiters (the next step).
            if observation.task_id == "awaited" and observation.status is RunStatus.SUCCEEDED:
                gone.set()
                await asyncio.sleep(3600)

        async def body() -> None:
            clock = ControlledClock()
            crashed, _ = self.runtime(
                lanes.new(), awaited, awaiting, clock=clock, observers=[stalls_on_the_finished_source]
            )
            survivor, _ = self.runtime(lanes.peer(), awaited, awaiting, clock=clock)
            async with survivor:
                await crashed.__aenter__()
                source = (await survivor.trigger(awaited, {})).run
                waiters = [(await survivor.run_now(awaiting, {"source": source.id})) for _ in range(3)]
                assert all(waiter.status is RunStatus.RELEASED for waiter in waiters)
                finishing = asyncio.ensure_future(crashed.execute_next())
                await asyncio.wait_for(gone.wait(), 10)
                finishing.cancel()
                await asyncio.gather(finishing, return_exceptions=True)
                assert (await survivor.runs.get(source.id)).status is RunStatus.SUCCEEDED
                for waiter in waiters:
                    assert (await survivor.runs.get(waiter.id)).status is RunStatus.RELEASED

                clock.advance("59s")
                assert (await survivor.tick()).delivery_requested == 0  # its process may still be at it
                clock.advance("1s")
                assert (await survivor.tick()).delivery_requested == 3
                done = [await survivor.execute_next() for _ in waiters]
                assert sorted(run.id for run in done) == sorted(waiter.id for waiter in waiters)
                assert {run.output for run in done} == {"resumed"}
                clock.advance("1h")
                assert (await survivor.tick()).delivery_requested == 0

        self.run(body)
