"""``runlane.testing.run_until_idle``: a test on a controlled clock plays out retries, releases, wait
timeouts and schedules in one call."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runlane import (
    ErrorCode,
    LaneDelivery,
    Retry,
    RunlaneError,
    RunSourceType,
    RunStatus,
    TaskContext,
    create_lane,
    create_runlane,
    queue,
    schedule,
    task,
)
from runlane.core.store import ClaimRequest
from runlane.testing import ControlledClock, list_run_event_types, run_until_idle
from runlane.vocabulary import LaneDeliveryMode
from runlane_local import local_lane, local_storage_driver
from runtime_support import make_runtime

START = datetime(2026, 1, 1, tzinfo=UTC)
calls: dict[str, int] = {}


@pytest.fixture(autouse=True)
def _fresh_calls():
    calls.clear()


def _count(name: str) -> int:
    calls[name] = calls.get(name, 0) + 1
    return calls[name]


@task("idle.flaky", retry=Retry(3, backoff="5m"))
async def flaky(payload: dict) -> str:
    if _count("flaky") < 3:
        raise ConnectionError("provider unavailable")
    return "sent"


@task("idle.polling")
async def polling(payload: dict, ctx: TaskContext):
    if _count("polling") == 1:
        return ctx.release("1h", reason="report_not_ready")
    return "ready"


@task("idle.approval")
async def approval(payload: dict, ctx: TaskContext):
    if payload.get("timeout"):
        return ctx.wait_for_signal("approved", timeout=payload["timeout"])
    return ctx.wait_for_signal("approved")


@task("idle.digest", schedule=schedule("idle.digest", every="15m", payload={}))
async def digest(payload: dict) -> None:
    return None


@task("idle.forever")
async def forever(payload: dict, ctx: TaskContext):
    return ctx.release("1m", reason="never_ready")


@task("idle.noop")
async def noop(payload: dict) -> None:
    return None


@task("idle.follower")
async def follower(payload: dict, ctx: TaskContext):
    if _count("follower") == 1:
        return ctx.wait_for_run(payload["leader"])
    return "followed"


@task("idle.timed", max_attempt_duration="10m", retry=Retry(2, backoff="1m"))
async def timed(payload: dict) -> str:
    return "recovered"


async def test_a_retried_run_runs_to_completion_and_the_clock_moves_exactly_its_backoffs():
    runlane, clock = make_runtime(flaky)
    async with runlane:
        run = (await runlane.trigger(flaky, {})).run
        executed = await run_until_idle(runlane, clock)
        assert [(record.id, record.status) for record in executed] == [
            (run.id, RunStatus.RETRYING),
            (run.id, RunStatus.RETRYING),
            (run.id, RunStatus.SUCCEEDED),
        ]
        assert executed[-1].output == "sent" and executed[-1].counters.attempts == 3
        assert clock.now() - START == timedelta(minutes=10)
        # Idle now: a second call executes nothing and leaves the clock alone.
        assert await run_until_idle(runlane, clock) == []
        assert clock.now() - START == timedelta(minutes=10)


async def test_a_released_run_resumes_when_its_release_is_over():
    runlane, clock = make_runtime(polling)
    async with runlane:
        run = (await runlane.trigger(polling, {})).run
        executed = await run_until_idle(runlane, clock)
        assert [record.status for record in executed] == [RunStatus.RELEASED, RunStatus.SUCCEEDED]
        assert executed[-1].id == run.id and executed[-1].output == "ready"
        assert clock.now() == START + timedelta(hours=1)


async def test_a_release_longer_than_max_advance_is_left_waiting_and_the_clock_is_not_moved_past_it():
    runlane, clock = make_runtime(polling)
    async with runlane:
        run = (await runlane.trigger(polling, {})).run
        executed = await run_until_idle(runlane, clock, max_advance="59m")
        assert [record.status for record in executed] == [RunStatus.RELEASED]
        assert clock.now() == START
        assert (await runlane.runs.get(run.id)).status is RunStatus.RELEASED
        # Exactly max_advance away is still within reach.
        executed = await run_until_idle(runlane, clock, max_advance="1h")
        assert [record.status for record in executed] == [RunStatus.SUCCEEDED]
        assert clock.now() == START + timedelta(hours=1)


async def test_a_schedule_fires_at_each_fire_time_within_max_advance_and_not_beyond():
    runlane, clock = make_runtime(digest)
    async with runlane:
        executed = await run_until_idle(runlane, clock, max_advance="1h")
        # The fire time at the start is caught up, then one every 15 minutes up to exactly one hour.
        assert [record.source.type for record in executed] == ["schedule"] * 5
        assert [record.status for record in executed] == [RunStatus.SUCCEEDED] * 5
        assert [record.created_at - START for record in executed] == [timedelta(minutes=15 * n) for n in range(5)]
        assert clock.now() == START + timedelta(hours=1)
        # The next call goes on from there.
        executed = await run_until_idle(runlane, clock, max_advance="30m")
        assert len(executed) == 2 and clock.now() == START + timedelta(hours=1, minutes=30)


async def test_without_tick_schedules_do_not_fire():
    runlane, clock = make_runtime(digest)
    async with runlane:
        assert await run_until_idle(runlane, clock, tick=False) == []
        assert clock.now() == START


async def test_a_cron_schedule_in_a_time_zone_fires_at_its_wall_clock_times():
    @task("idle.paris", schedule=schedule("idle.paris", cron="0 9 * * *", time_zone="Europe/Paris", payload={}))
    async def paris(payload: dict) -> None:
        return None

    # 2026-03-29: Paris moves from UTC+1 to UTC+2, so 09:00 there is 08:00 UTC, then 07:00 UTC.
    runlane, clock = make_runtime(paris, clock=ControlledClock(datetime(2026, 3, 27, 9, 0, tzinfo=UTC)))
    async with runlane:
        executed = await run_until_idle(runlane, clock, max_advance="3d")
        assert [record.created_at for record in executed] == [
            datetime(2026, 3, 27, 9, 0, tzinfo=UTC),  # the first tick catches up the morning's fire time
            datetime(2026, 3, 28, 8, 0, tzinfo=UTC),
            datetime(2026, 3, 29, 7, 0, tzinfo=UTC),
            datetime(2026, 3, 30, 7, 0, tzinfo=UTC),
        ]


async def test_a_run_waiting_for_a_signal_is_left_waiting():
    runlane, clock = make_runtime(approval)
    async with runlane:
        run = (await runlane.trigger(approval, {})).run
        executed = await run_until_idle(runlane, clock)
        assert [record.status for record in executed] == [RunStatus.RELEASED]
        assert clock.now() == START
        waiting = await runlane.runs.get(run.id)
        assert waiting.status is RunStatus.RELEASED and waiting.wait.signal_key == "approved"

        await runlane.signals.send("approved")
        executed = await run_until_idle(runlane, clock)
        assert [record.status for record in executed] == [RunStatus.RELEASED]  # and it waits again


async def test_a_signal_wait_with_a_timeout_runs_again_at_the_timeout():
    runlane, clock = make_runtime(approval)
    async with runlane:
        run = (await runlane.trigger(approval, {"timeout": "2h"})).run
        executed = await run_until_idle(runlane, clock, max_advance="3h")
        assert [record.status for record in executed] == [RunStatus.RELEASED, RunStatus.RELEASED]
        assert clock.now() == START + timedelta(hours=2)
        assert (await runlane.runs.get(run.id)).wait.timeout_at == START + timedelta(hours=4)


async def test_a_delayed_trigger_runs_at_its_time():
    runlane, clock = make_runtime(noop)
    async with runlane:
        run = (await runlane.trigger(noop, {}, delay="90s")).run
        executed = await run_until_idle(runlane, clock, tick=False)
        assert [(record.id, record.status) for record in executed] == [(run.id, RunStatus.SUCCEEDED)]
        assert clock.now() == START + timedelta(seconds=90)


async def test_a_run_waiting_for_another_run_resumes_when_it_finishes_at_the_same_time():
    runlane, clock = make_runtime(polling, follower)
    async with runlane:
        leader = (await runlane.trigger(polling, {})).run
        waiting = (await runlane.trigger(follower, {"leader": leader.id})).run
        executed = await run_until_idle(runlane, clock)
        assert [(record.id, record.status) for record in executed] == [
            (leader.id, RunStatus.RELEASED),
            (waiting.id, RunStatus.RELEASED),
            (leader.id, RunStatus.SUCCEEDED),
            (waiting.id, RunStatus.SUCCEEDED),
        ]
        assert clock.now() == START + timedelta(hours=1)


async def _claim_as_a_worker_that_dies(runlane, run_id: str) -> None:
    (claim,) = await runlane.store.claim(
        [ClaimRequest(run_id, None, "dead-worker", "token", 3_600_000, 600_000, also_start=True)]
    )
    assert claim.claimed


async def test_a_run_whose_worker_died_is_finalized_at_its_deadline_and_retried():
    runlane, clock = make_runtime(timed)
    async with runlane:
        run = (await runlane.trigger(timed, {})).run
        await _claim_as_a_worker_that_dies(runlane, run.id)
        executed = await run_until_idle(runlane, clock)
        assert [(record.status, record.counters.attempts) for record in executed] == [(RunStatus.SUCCEEDED, 2)]
        assert executed[0].output == "recovered"
        # The attempt timed out at its 10-minute deadline (a tick), and the retry ran a minute later.
        assert clock.now() == START + timedelta(minutes=11)


@task("idle.stops_when_told", max_attempt_duration="1m", retry=Retry(2, backoff="5m"))
async def stops_when_told(payload: dict, ctx: TaskContext) -> str:
    if _count("stops_when_told") == 1:
        await ctx.signal.wait()  # the documented way to stop at the deadline
        ctx.signal.raise_if_aborted()
    return "in time"


@task("idle.stops_when_told_in_a_thread", max_attempt_duration="1m")
def stops_when_told_in_a_thread(payload: dict, ctx: TaskContext) -> None:
    ctx.signal.wait_sync()
    ctx.signal.raise_if_aborted()


async def test_a_handler_waiting_for_its_signal_times_out_at_its_deadline_and_is_retried():
    """Only the clock reaching its max_attempt_duration deadline ends such an attempt: moved there, as
    a time-skipping test environment does, instead of waiting for ever."""
    runlane, clock = make_runtime(stops_when_told)
    async with runlane:
        await runlane.trigger(stops_when_told, {})
        executed = await run_until_idle(runlane, clock)
    assert [(record.status, record.failure and record.failure.code) for record in executed] == [
        (RunStatus.RETRYING, ErrorCode.TASK_TIMED_OUT),
        (RunStatus.SUCCEEDED, None),
    ]
    assert clock.now() == START + timedelta(minutes=6)  # the deadline, then the 5-minute backoff


async def test_a_def_handler_waiting_for_its_signal_times_out_at_its_deadline():
    runlane, clock = make_runtime(stops_when_told_in_a_thread)
    async with runlane:
        await runlane.trigger(stops_when_told_in_a_thread, {})
        executed = await run_until_idle(runlane, clock)
    assert [(record.status, record.failure and record.failure.code) for record in executed] == [
        (RunStatus.FAILED, ErrorCode.TASK_TIMED_OUT)
    ]
    assert clock.now() == START + timedelta(minutes=1)


async def test_a_handler_waiting_for_its_signal_past_max_advance_fails_the_test_instead_of_hanging_it():
    """Its deadline, the only thing that can end it, lies past max_advance: the call hung for ever, as the
    clock was never moved there and the attempt never ended."""
    import asyncio

    runlane, clock = make_runtime(stops_when_told)
    async with runlane:
        run = (await runlane.trigger(stops_when_told, {})).run
        with pytest.raises(RuntimeError, match=r"waits for its signal alone") as raised:
            await asyncio.wait_for(run_until_idle(runlane, clock, max_advance="59s"), 10)
        message = str(raised.value)
        assert run.id in message and "idle.stops_when_told" in message
        assert "2026-01-01T00:01:00Z" in message and "max_advance" in message
        assert clock.now() == START  # not moved past max_advance


@task("idle.waits_for_its_signal_without_a_deadline")
async def waits_without_a_deadline(payload: dict, ctx: TaskContext) -> str:
    await ctx.signal.wait()
    return "stopped"


@task("idle.waits_for_its_signal_without_a_deadline_in_a_thread")
def waits_without_a_deadline_in_a_thread(payload: dict, ctx: TaskContext) -> str:
    ctx.signal.wait_sync()
    return "stopped"


@pytest.mark.parametrize("waiting", [waits_without_a_deadline, waits_without_a_deadline_in_a_thread])
async def test_a_handler_waiting_for_its_signal_without_a_deadline_fails_the_test_instead_of_hanging_it(waiting):
    """Its task sets no max_attempt_duration, so nothing can end it: the call hung for ever."""
    import asyncio

    runlane, clock = make_runtime(waiting)
    async with runlane:
        run = (await runlane.trigger(waiting, {})).run
        with pytest.raises(RuntimeError, match=r"waits for its signal alone") as raised:
            await asyncio.wait_for(run_until_idle(runlane, clock), 10)
        message = str(raised.value)
        assert run.id in message and waiting.id in message
        assert "sets no max_attempt_duration" in message
        assert clock.now() == START


def test_a_def_handler_given_up_on_is_told_to_stop_so_its_thread_ends():
    """The call failed the test, but the handler's thread went on waiting for a signal nothing would abort,
    and held up the exit of the test process for ever (concurrent.futures joins its threads at exit)."""
    import threading

    told: list[str | None] = []
    returned = threading.Event()

    @task("idle.told_to_stop_in_a_thread")
    def waits(payload: dict, ctx: TaskContext) -> None:
        ctx.signal.wait_sync()
        told.append(ctx.signal.reason)
        returned.set()

    runlane, clock = make_runtime(waits)
    try:
        runlane.sync.trigger(waits, {})
        with pytest.raises(RuntimeError, match=r"waits for its signal alone"):
            runlane.sync.call(run_until_idle, runlane, clock)
        assert returned.wait(5), "the handler's thread is still waiting"
        assert told == ["worker_stopped"]
    finally:
        runlane.sync.close()


@task("idle.sleeps_unless_stopped")
async def sleeps_unless_stopped(payload: dict, ctx: TaskContext) -> int:
    import asyncio

    for _ in range(40):  # a pause between batches that a stop cuts short: not a wait for the signal alone
        try:
            await asyncio.wait_for(ctx.signal.wait(), 0.005)
        except TimeoutError:
            pass
    return 40


@task("idle.sleeps_unless_stopped_in_a_thread")
def sleeps_unless_stopped_in_a_thread(payload: dict, ctx: TaskContext) -> int:
    for _ in range(40):
        ctx.signal.wait_sync(0.005)
    return 40


@task("idle.sleeps_unless_stopped_with_a_deadline", max_attempt_duration="1m")
async def sleeps_unless_stopped_with_a_deadline(payload: dict, ctx: TaskContext) -> int:
    return await sleeps_unless_stopped.handler(payload, ctx)


@pytest.mark.parametrize(
    "sleeping", [sleeps_unless_stopped, sleeps_unless_stopped_in_a_thread, sleeps_unless_stopped_with_a_deadline]
)
async def test_a_handler_pausing_on_its_signal_again_and_again_is_waited_for(sleeping, monkeypatch):
    """Each pause ends by itself and another begins: the handler makes progress, so it is not taken for one
    that nothing will end, however long its pauses add up to (it failed the test), nor timed out by the clock
    moved to its deadline (it failed with task_timed_out)."""
    import runlane.testing.driving as driving

    monkeypatch.setattr(driving, "_STUCK_S", 0.05)  # well under the 40 pauses of 5 ms
    runlane, clock = make_runtime(sleeping)
    async with runlane:
        await runlane.trigger(sleeping, {})
        executed = await run_until_idle(runlane, clock)
    assert [(record.status, record.output) for record in executed] == [(RunStatus.SUCCEEDED, 40)]
    assert clock.now() == START


async def test_without_tick_a_run_whose_worker_died_is_claimed_again_when_its_lease_expires():
    runlane, clock = make_runtime(timed)
    async with runlane:
        run = (await runlane.trigger(timed, {})).run
        await _claim_as_a_worker_that_dies(runlane, run.id)
        executed = await run_until_idle(runlane, clock, tick=False)
        assert [(record.status, record.counters.attempts) for record in executed] == [(RunStatus.SUCCEEDED, 2)]
        assert clock.now() == START + timedelta(hours=1)


async def test_the_limit_stops_a_task_that_releases_itself_forever():
    runlane, clock = make_runtime(forever)
    async with runlane:
        run = (await runlane.trigger(forever, {})).run
        with pytest.raises(RuntimeError, match=r"executed 25 runs, its limit") as raised:
            await run_until_idle(runlane, clock, limit=25)
        assert run.id in str(raised.value) and "idle.forever" in str(raised.value)
        assert (await runlane.runs.get(run.id)).counters.attempts == 25
        assert clock.now() == START + timedelta(minutes=24)
        assert (await list_run_event_types(runlane, run.id)).count("run.released") == 25


async def test_reaching_the_limit_with_nothing_left_to_do_is_not_an_error():
    runlane, clock = make_runtime(flaky)
    async with runlane:
        await runlane.trigger(flaky, {})
        executed = await run_until_idle(runlane, clock, limit=3)
        assert executed[-1].status is RunStatus.SUCCEEDED


@pytest.mark.parametrize(
    ("arguments", "options", "message"),
    [
        ("sync", {}, r"not runlane.sync, and await the call \(in a synchronous test: runlane.sync.call\("),
        ("lane", {}, "takes the runtime from create_runlane"),
        ("no clock", {}, "moves a ControlledClock, got NoneType"),
        ("other clock", {}, "a ControlledClock the runtime does not use"),
        ("ok", {"max_advance": "soon"}, "Invalid max_advance 'soon'"),
        ("ok", {"max_advance": 3600}, "Invalid max_advance"),
        ("ok", {"limit": 0}, "limit must be a positive whole number"),
        ("ok", {"limit": True}, "limit must be a positive whole number"),
        ("ok", {"tick": "yes"}, "tick must be True or False"),
    ],
)
async def test_bad_arguments_are_configuration_errors(arguments: str, options: dict, message: str):
    runlane, clock = make_runtime(noop)
    first: object = runlane
    second: object = clock
    if arguments == "sync":
        first = runlane.sync
    elif arguments == "lane":
        first = runlane.lane
    elif arguments == "no clock":
        second = None
    elif arguments == "other clock":
        second = ControlledClock()
    async with runlane:
        with pytest.raises(RunlaneError, match=message) as raised:
            await run_until_idle(first, second, **options)  # type: ignore[arg-type]
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert clock.now() == START


async def test_a_runtime_on_the_system_clock_is_refused():
    runlane = create_runlane(lane=local_lane(), queues=[queue("default", default=True)], tasks=[noop])
    async with runlane:
        with pytest.raises(RunlaneError, match="does not use") as raised:
            await run_until_idle(runlane, ControlledClock())
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_a_lane_without_operator_reads_is_refused():
    clock = ControlledClock()
    lane = create_lane(
        storage=local_storage_driver(clock=clock),
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        operator_reads=False,
    )
    runlane = create_runlane(lane=lane, queues=[queue("default", default=True)], tasks=[noop], clock=clock)
    async with runlane:
        with pytest.raises(RunlaneError, match="operator reads") as raised:
            await run_until_idle(runlane, clock)
        assert raised.value.code is ErrorCode.CAPABILITY_UNSUPPORTED


async def test_a_one_off_fire_time_that_met_a_singleton_conflict_is_tried_again_when_its_claim_expires():
    fire_at = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
    calls: list[bool] = []

    @task(
        "accounts.sync",
        singleton_key=lambda payload: "account_123",
        schedule=schedule("accounts.full_resync", run_at=fire_at, payload={"full": True}),
    )
    async def sync(payload: dict, ctx: TaskContext) -> Any:
        calls.append(payload["full"])
        if not payload["full"] and len(calls) == 1:
            return ctx.release("20m")  # still holding the singleton key at 09:00
        return None

    runlane, clock = make_runtime(sync, clock=ControlledClock(fire_at - timedelta(minutes=10)))
    async with runlane:
        await runlane.trigger(sync, {"full": False})
        executed = await run_until_idle(runlane, clock)
    assert calls == [False, False, True]  # the one-off ran once its key was free and its claim expired
    scheduled = [run for run in executed if run.source is not None and run.source.type is RunSourceType.SCHEDULE]
    assert [(run.payload, run.status) for run in scheduled] == [({"full": True}, RunStatus.SUCCEEDED)]
