"""Two releases of an application's tasks over one store, as during a rolling deploy: what an operator sees
when a worker of one release meets a run the other one queued, and how the run gets going again."""

from __future__ import annotations

import io
import json
from typing import Any

from pydantic import BaseModel

from runlane import ErrorCode, RunStatus, TaskContext, task
from runlane.cli.output import Output

from runtime_support import shared_runtimes


class OrderV1(BaseModel):
    order_id: int
    note: str = ""


class OrderV2(BaseModel):  # renamed note to comment, and made it required
    order_id: int
    comment: str


class OrderV3(BaseModel):  # the fix: the new field has a default again
    order_id: int
    comment: str = ""


@task("orders.ship")
async def ship_v1(payload: OrderV1) -> dict:
    return {"release": 1}


@task("orders.ship")
async def ship_v2(payload: OrderV2) -> dict:
    return {"release": 2}


@task("orders.ship")
async def ship_v3(payload: OrderV3) -> dict:
    return {"release": 3}


async def test_a_run_whose_payload_no_longer_validates_fails_naming_the_fields_and_the_way_back() -> None:
    (v1, v2, v3), _ = shared_runtimes([ship_v1], [ship_v2], [ship_v3])
    async with v1, v2, v3:
        queued = (await v1.trigger(ship_v1, {"order_id": 7, "note": "fragile-secret"})).run
        failed = await v2.execute_next()
        assert failed is not None and failed.id == queued.id and failed.status is RunStatus.FAILED
        failure = failed.failure
        assert failure is not None and failure.code is ErrorCode.VALIDATION_FAILED and not failure.retryable
        # The task, the field and what to do; never the stored values.
        assert failure.message.startswith(
            "Task payload no longer matches the schema of task 'orders.ship': comment: Field required. "
        )
        assert "retry this run" in failure.message and "fragile-secret" not in failure.message
        assert failure.meta["errors"] == [{"type": "missing", "loc": ["comment"], "msg": "Field required"}]
        # Once a release reads the stored payload again, a retry of the run runs it.
        retried = await v3.runs.retry(failed.id)
        done = await v3.execute_next()
        assert done is not None and done.id == retried.id and done.status is RunStatus.SUCCEEDED
        assert done.output == {"release": 3}


async def test_a_run_of_a_task_the_worker_lacks_fails_naming_the_task_and_runs_again_by_retry() -> None:
    submitted: list[str] = []
    released: set[str] = set()

    @task("reports.build")
    def build(payload: dict, ctx: TaskContext) -> dict:
        job = ctx.step.run("submit", lambda token: submitted.append(token) or {"job": len(submitted)})
        if ctx.run_id not in released:
            released.add(ctx.run_id)
            return ctx.release("1ms")
        return job

    @task("reports.other")
    async def other(payload: dict) -> None:
        return None

    (v1, v2), clock = shared_runtimes([build, other], [other])
    async with v1, v2:
        run = (await v1.trigger(build, {})).run
        assert (await v1.execute_next()).status is RunStatus.RELEASED
        clock.advance("1s")
        failed = await v2.execute_next()  # a worker of the release that removed the task
        assert failed is not None and failed.id == run.id and failed.status is RunStatus.FAILED
        failure = failed.failure
        assert failure is not None and failure.code is ErrorCode.TASK_NOT_FOUND and not failure.retryable
        assert failure.message.startswith("Task 'reports.build' is not registered in the runtime of the worker")
        assert "queue 'default'" in failure.message and "retry this run" in failure.message
        assert failure.meta == {"task_id": "reports.build"}
        # The release that has the task retries it: a new run, which calls its steps again.
        retried = await v1.runs.retry(failed.id)
        done = await v1.execute_next()
        assert done is not None and done.id == retried.id and done.status is RunStatus.RELEASED
        clock.advance("1s")
        done = await v1.execute_next()
        assert done is not None and done.status is RunStatus.SUCCEEDED and done.output == {"job": 2}
        assert len(submitted) == 2


async def test_runs_get_shows_a_drifted_step_output_once_and_calls_it_output() -> None:
    class Submission(BaseModel):
        job_id: int

    @task("reports.print")
    def print_v1(payload: dict, ctx: TaskContext) -> dict:
        ctx.step.run("submit", lambda token: {"job_id": "print_1"})
        return ctx.release("1ms")

    @task("reports.print")
    def print_v2(payload: dict, ctx: TaskContext) -> dict:
        return ctx.step.run("submit", lambda token: {"job_id": 2}, output=Submission).model_dump()

    (v1, v2), clock = shared_runtimes([print_v1], [print_v2])
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=400)
    async with v1, v2:
        await v1.trigger(print_v1, {})
        assert (await v1.execute_next()).status is RunStatus.RELEASED
        clock.advance("1s")
        failed = await v2.execute_next()
        assert failed is not None and failed.status is RunStatus.FAILED
        assert failed.failure is not None and failed.failure.meta["step_key"] == "submit"
        output.run_detail(failed, await v2.runs.events(failed.id))
    text = buffer.getvalue()
    summary = "job_id: Input should be a valid integer, unable to parse string as an integer"
    assert f"The stored output of step 'submit' no longer matches its output schema: {summary}." in text
    assert f"({summary})" not in text and "(payload:" not in text
    assert json.dumps(failed.failure.meta)  # the errors stay in meta, as --json shows them


async def test_a_renamed_schedule_fires_under_both_ids_while_both_releases_tick() -> None:
    # What operations.md says of schedules during a rollout: the first tick of the new id catches up the
    # fire time the old id ran, and each later fire time runs under both ids; starts_at= avoids both.
    from datetime import UTC, datetime, timedelta

    from runlane import schedule
    from runlane.testing import ControlledClock

    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    @task("reports.digest", schedule=schedule("reports.digest", every="10m", payload={}))
    async def digest_v1(payload: dict) -> None:
        return None

    @task("reports.digest", schedule=schedule("reports.digest.v2", every="10m", payload={}))
    async def digest_v2(payload: dict) -> None:
        return None

    next_fire_time = t0 + timedelta(minutes=10)

    @task("reports.digest", schedule=schedule("reports.digest.v2", every="10m", payload={}, starts_at=next_fire_time))
    async def digest_v2_from_next_fire_time(payload: dict) -> None:
        return None

    for renamed, expected in ((digest_v2, [1, 1, 1, 1]), (digest_v2_from_next_fire_time, [1, 0, 1])):
        (v1, v2), clock = shared_runtimes([digest_v1], [renamed], clock=ControlledClock(t0 + timedelta(minutes=5)))
        async with v1, v2:
            counts = [(await v1.tick()).materialized]  # 00:00 under the old id
            clock.advance("3m")
            counts.append((await v2.tick()).materialized)  # the new id's first tick, at 00:08
            clock.advance("5m")
            if renamed is digest_v2:
                counts.append((await v1.tick()).materialized)  # 00:10 under the old id
            # else the earlier release's maintenance stopped before 00:10
            counts.append((await v2.tick()).materialized)  # and under the new one
            assert counts == expected, renamed.schedules



async def test_a_concurrency_limit_changed_by_a_release_counts_only_the_slots_runs_hold() -> None:
    # What operations.md says of a queue whose limit a release changed, on a polling lane: runs the earlier
    # release started keep their slots (none, under no limit), and the new release's workers start runs
    # up to its own limit beside them.
    import asyncio

    from runlane import LaneDelivery, LaneDeliveryMode, create_lane, create_runlane, queue
    from runlane.testing import ControlledClock, wait_for_condition
    from runlane_local import LocalStorageStore, local_storage_driver

    from runtime_support import DEFAULT_QUEUE

    gates: list[asyncio.Event] = []

    def release(store: LocalStorageStore, clock: ControlledClock, limit: int | None, name: str) -> Any:
        work = queue("work", concurrency_limit=limit)

        @task("batch.import", queue=work)
        async def batch_import(payload: dict) -> None:
            gate = asyncio.Event()
            gates.append(gate)
            await gate.wait()

        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
            name=name,
        )
        return create_runlane(lane=lane, queues=[DEFAULT_QUEUE, work], tasks=[batch_import], clock=clock)

    async def claim(runtime: Any) -> asyncio.Task:
        started = len(gates)
        claimed = asyncio.create_task(runtime.execute_next())
        await wait_for_condition(lambda: claimed.done() or len(gates) > started, timeout="5s")
        return claimed

    for earlier, later, running in ((1, 3, 3), (3, 1, 3), (None, 1, 4), (1, None, 4)):
        gates.clear()
        store, clock = LocalStorageStore(), ControlledClock()
        v1, v2 = release(store, clock, earlier, "v1"), release(store, clock, later, "v2")
        async with v1, v2:
            for _ in range(6):
                await v1.trigger("batch.import", {})
            claims: list[asyncio.Task] = []
            try:
                claims += [await claim(v1) for _ in range(3)]
                claims += [await claim(v2) for _ in range(3)]
                assert len(gates) == running, (earlier, later)
            finally:  # closing the runtimes waits for their handlers
                for gate in gates:
                    gate.set()
                await asyncio.wait_for(asyncio.gather(*claims), 5)


def test_a_worker_of_a_release_without_the_queue_it_is_told_to_serve_says_what_to_do(tmp_path) -> None:
    # The earlier release's command line (runlane work --queue imports) kept by the process manager for
    # a release that renamed the queue: the worker refuses to start, naming what it has and what to do.
    from cli_support import cli, make_project

    tasks = """
from runlane import queue, task

default = queue("default", default=True)
bulk = queue("bulk-imports")


@task("imports.run", queue=bulk)
def run_import(payload: dict) -> None:
    return None
"""
    root = make_project(tmp_path, tasks, lane="sqlite")
    result = cli(root, "work", "--drain", "--queue", "imports")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error[configuration_invalid]: Queue 'imports' is not registered in this runtime;")
    assert "registered queues: ['bulk-imports', 'default']. Name one of those, or register queue('imports')" in (
        result.stderr
    )


async def test_a_schedule_changed_by_a_release_fires_each_fire_time_once_with_the_payload_of_the_first_tick() -> None:
    from datetime import UTC, datetime, timedelta

    from runlane import schedule
    from runlane.testing import ControlledClock

    from runtime_support import all_runs

    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    @task("reports.digest", schedule=schedule("reports.digest", every="10m", payload={"release": 1}))
    async def digest_v1(payload: dict) -> None:
        return None

    @task("reports.digest", schedule=schedule("reports.digest", cron="*/15 * * * *", payload={"release": 2}))
    async def digest_v2(payload: dict) -> None:
        return None

    (v1, v2), clock = shared_runtimes([digest_v1], [digest_v2], clock=ControlledClock(t0 + timedelta(minutes=21)))
    async with v1, v2:
        assert (await v1.tick()).materialized == 1  # 00:20
        assert (await v2.tick()).materialized == 0  # 00:15 is older than 00:20: skipped
        clock.advance("10m")
        assert (await v2.tick()).materialized == 1  # 00:30, a fire time of both
        assert (await v1.tick()).materialized == 0  # already taken
        runs = [await v1.runs.get(summary.id) for summary in await all_runs(v1)]
        assert sorted(run.payload["release"] for run in runs) == [1, 2]
