"""``runlane.runs.step`` / ``runs.steps`` and ``runlane runs steps``: reading what a run's durable steps stored."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from runlane import ErrorCode, Retry, RunlaneError, RunStatus, TaskContext, create_runlane, task
from runlane.cli.output import Output
from runlane.core.attempt import step_token
from runlane.core.store import run_step_key
from runlane.models import Page, RunStepRecord
from runlane.testing import ControlledClock
from runlane_local import sqlite_lane

from cli_support import cli, make_project
from runtime_support import DEFAULT_QUEUE, make_runtime
from sql_driver_support import edit_sqlite_document


@task("steps.flaky", retry=Retry(2, backoff="10s"))
async def flaky(payload: dict, ctx: TaskContext) -> str:
    # Steps completed in an order unlike their key order; the first attempt fails after two of them.
    await ctx.step.run("charge", lambda token: {"charge": ctx.attempt})
    await ctx.step.run("b-reserve", lambda token: ["seat", ctx.attempt])
    if ctx.attempt == 1:
        raise RuntimeError("provider down")
    await ctx.step.run("a-notify", lambda token: None)
    await ctx.step.run("d-audit", lambda token: "audited")
    return "done"


@task("steps.none")
async def no_steps(payload: dict) -> str:
    return "done"


async def _retried_run(runtime, clock) -> str:
    run = (await runtime.trigger(flaky, {})).run
    assert (await runtime.execute_next()).status is RunStatus.RETRYING
    clock.advance("10s")
    assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
    return run.id


async def test_steps_lists_every_completed_step_in_key_order_with_its_attempt_and_output():
    runtime, clock = make_runtime(flaky, no_steps)
    async with runtime:
        run_id = await _retried_run(runtime, clock)
        page = await runtime.runs.steps(run_id)
        assert page.next_cursor is None
        assert [(step.step_key, step.attempt, step.output) for step in page.data] == [
            ("a-notify", 2, None),
            ("b-reserve", 1, ["seat", 1]),
            ("charge", 1, {"charge": 1}),
            ("d-audit", 2, "audited"),
        ]
        assert all(step.run_id == run_id for step in page.data)
        assert page.data[0].token == step_token(runtime.environment, run_id, "a-notify")
        assert page.data[0].completed_at == page.data[3].completed_at > page.data[1].completed_at

        assert (await runtime.runs.step(run_id, "charge")) == page.data[2]
        assert await runtime.runs.step(run_id, "never-ran") is None

        other = await runtime.run_now(no_steps, {})
        assert (await runtime.runs.steps(other.id)).data == []


async def test_steps_pages_with_a_limit_and_cursors_to_the_end():
    runtime, clock = make_runtime(flaky)
    async with runtime:
        run_id = await _retried_run(runtime, clock)
        pages = []
        cursor = None
        while True:
            page = await runtime.runs.steps(run_id, cursor=cursor, limit=2)
            pages.append([step.step_key for step in page.data])
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert pages == [["a-notify", "b-reserve"], ["charge", "d-audit"]]
        # A large limit is clamped, not refused.
        assert len((await runtime.runs.steps(run_id, limit=10_000)).data) == 4


async def test_steps_refuses_a_cursor_of_another_run_and_malformed_cursors():
    runtime, clock = make_runtime(flaky)
    async with runtime:
        first = await _retried_run(runtime, clock)
        second = await _retried_run(runtime, clock)
        cursor = (await runtime.runs.steps(first, limit=1)).next_cursor
        assert cursor is not None
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.steps(second, cursor=cursor)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED and raised.value.meta == {"field": "cursor"}
        assert f"steps of run {second}" in raised.value.message and "restart the listing" in raised.value.message
        # Nor a cursor of another listing.
        events_cursor = (await runtime.runs.events(first, limit=1)).next_cursor
        for bad in (events_cursor, "not-a-cursor", cursor[:-3]):
            with pytest.raises(RunlaneError) as raised:
                await runtime.runs.steps(first, cursor=bad)
            assert raised.value.code is ErrorCode.VALIDATION_FAILED, bad
            assert raised.value.meta == {"field": "cursor"}


async def test_a_cursor_of_another_listing_or_run_is_refused_naming_which_not_another_environment():
    """A ``runs.list`` cursor given to ``runs.steps`` (or a steps cursor to ``runs.list``) was refused as
    belonging to "another environment", though both came from this one: the steps scope holds the
    environment by its key, the other listings as an object, and the two were compared as they were."""
    runtime, clock = make_runtime(flaky)
    async with runtime:
        first = await _retried_run(runtime, clock)
        second = await _retried_run(runtime, clock)
        listing = (await runtime.runs.list(limit=1)).next_cursor
        events = (await runtime.runs.events(first, limit=1)).next_cursor
        steps = (await runtime.runs.steps(first, limit=1)).next_cursor
        assert listing is not None and events is not None and steps is not None
        calls = [
            (runtime.runs.steps(first, cursor=listing), "another listing (a run list)"),
            (runtime.runs.steps(first, cursor=events), "another listing (a run's events)"),
            (runtime.runs.list(cursor=steps), "another listing (a run's steps)"),
            (runtime.runs.events(first, cursor=listing), "another listing (a run list)"),
            (runtime.runs.events(second, cursor=events), "another run"),
            (runtime.runs.steps(second, cursor=steps), "another run"),
        ]
        for call, belongs_to in calls:
            with pytest.raises(RunlaneError) as raised:
                await call
            assert raised.value.code is ErrorCode.VALIDATION_FAILED and raised.value.meta == {"field": "cursor"}
            assert f"This cursor belongs to {belongs_to}; restart the listing" in raised.value.message


@pytest.mark.parametrize("limit", [0, -1, True, "2", 1.5])
async def test_steps_rejects_a_limit_that_is_not_a_positive_whole_number(limit):
    runtime, clock = make_runtime(flaky)
    async with runtime:
        run_id = await _retried_run(runtime, clock)
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.steps(run_id, limit=limit)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert "limit" in raised.value.message


async def test_unknown_and_pruned_runs_are_run_not_found_and_bad_ids_validation_failed():
    runtime, clock = make_runtime(flaky)
    async with runtime:
        run_id = await _retried_run(runtime, clock)
        for call in (lambda: runtime.runs.steps("run_missing"), lambda: runtime.runs.step("run_missing", "charge")):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.RUN_NOT_FOUND
            assert raised.value.meta == {"run_id": "run_missing", "environment": runtime.environment.name}
            # Where environments share a database, another environment's run is the likeliest cause.
            expected = f"Run run_missing does not exist in environment {runtime.environment.name!r}."
            assert raised.value.message == expected

        for call in (
            lambda: runtime.runs.steps("bad:id"),
            lambda: runtime.runs.step("bad:id", "charge"),
            lambda: runtime.runs.step(run_id, ""),
            lambda: runtime.runs.step(run_id, "bad:key"),
        ):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.VALIDATION_FAILED

        clock.advance("2d")
        assert (await runtime.runs.prune(older_than="1d")).pruned == 1
        for call in (lambda: runtime.runs.steps(run_id), lambda: runtime.runs.step(run_id, "charge")):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.RUN_NOT_FOUND


async def test_a_corrupt_step_record_is_an_invariant_violation_naming_it(tmp_path: Path):
    path = tmp_path / "runlane.db"
    clock = ControlledClock()

    def open_runtime():
        return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[flaky], clock=clock)

    async with open_runtime() as runtime:
        run_id = await _retried_run(runtime, clock)
        key = run_step_key(runtime.store.env_key, run_id, "charge")

    def damage(document: dict) -> None:
        document["value"]["attempt"] = 0

    edit_sqlite_document(path, key, damage)
    async with open_runtime() as runtime:
        for call in (lambda: runtime.runs.steps(run_id), lambda: runtime.runs.step(run_id, "charge")):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.INVARIANT_VIOLATION
            assert "stored run step" in raised.value.message and "attempt" in raised.value.message
        # The others still read.
        assert (await runtime.runs.step(run_id, "a-notify")).attempt == 2


async def test_closed_runtime_and_a_lane_without_operator_reads_are_refused():
    from runlane import LaneDelivery, LaneDeliveryMode, create_lane
    from runlane_local import local_storage_driver

    lane = create_lane(
        storage=local_storage_driver(),
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        operator_reads=False,
    )
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[no_steps])
    async with runtime:
        run = await runtime.run_now(no_steps, {})
        for call in (lambda: runtime.runs.steps(run.id), lambda: runtime.runs.step(run.id, "charge")):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.CAPABILITY_UNSUPPORTED
            assert "operator_reads=True" in raised.value.message
    with pytest.raises(RunlaneError):
        await runtime.runs.steps(run.id)


def test_the_sync_facade_reads_steps():
    runtime, clock = make_runtime(flaky)
    facade = runtime.sync
    with facade:
        run_id = facade.trigger(flaky, {}).run.id
        facade.execute_next()
        clock.advance("10s")
        assert facade.execute_next().status is RunStatus.SUCCEEDED
        first = facade.runs.steps(run_id, limit=3)
        assert [step.step_key for step in first.data] == ["a-notify", "b-reserve", "charge"]
        rest = facade.runs.steps(run_id, cursor=first.next_cursor)
        assert [step.step_key for step in rest.data] == ["d-audit"] and rest.next_cursor is None
        assert facade.runs.step(run_id, "d-audit").output == "audited"
        assert facade.runs.step(run_id, "absent") is None
        with pytest.raises(RunlaneError) as raised:
            facade.runs.steps("run_missing")
        assert raised.value.code is ErrorCode.RUN_NOT_FOUND


CLI_TASKS = """
from runlane import Retry, queue, task

jobs = queue("jobs", default=True)


@task("jobs.steps", queue=jobs, retry=Retry(2, backoff="1ms"))
def with_steps(payload: dict, ctx) -> str:
    ctx.step.run("charge", lambda token: {"amount": 42, "note": "x" * 500})
    if ctx.attempt == 1:
        raise RuntimeError("provider down")
    ctx.step.run("a-notify", lambda token: "sent")
    ctx.step.run("b-audit", lambda token: None)
    return "done"
"""


def test_cli_runs_steps_table_json_paging_and_errors(tmp_path: Path) -> None:
    project = make_project(tmp_path, CLI_TASKS, lane="sqlite")
    run_id = json.loads(cli(project, "--json", "trigger", "jobs.steps", "{}").stdout)["run"]["id"]
    done = cli(project, "dev", "--once")  # the retry is due 1 ms later: one drain runs both attempts
    assert done.returncode == 0, done.stderr

    table = cli(project, "runs", "steps", run_id)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["step", "attempt", "completed", "output"]
    assert [line.split()[:2] for line in lines[1:]] == [["a-notify", "2"], ["b-audit", "2"], ["charge", "1"]]
    assert lines[1].rstrip().endswith('"sent"') and lines[2].rstrip().endswith("null")
    # A long output is cut to the line width (400 columns when piped).
    assert lines[3].startswith("charge") and '{"amount":42,"note":"xxx' in lines[3] and lines[3].endswith("…")
    assert all(len(line) <= 400 for line in lines)
    assert "next cursor" not in table.stdout

    as_json = cli(project, "--json", "runs", "steps", run_id)
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["run_id"] == run_id and document["next_cursor"] is None
    assert [(step["step_key"], step["attempt"]) for step in document["data"]] == [
        ("a-notify", 2), ("b-audit", 2), ("charge", 1)
    ]
    assert document["data"][2]["output"] == {"amount": 42, "note": "x" * 500}

    first = json.loads(cli(project, "--json", "runs", "steps", run_id, "--limit", "2").stdout)
    assert [step["step_key"] for step in first["data"]] == ["a-notify", "b-audit"] and first["next_cursor"]
    paged = cli(project, "runs", "steps", run_id, "--limit", "2")
    assert f"next cursor  {first['next_cursor']}" in paged.stdout
    rest = json.loads(cli(project, "--json", "runs", "steps", run_id, "--cursor", first["next_cursor"]).stdout)
    assert [step["step_key"] for step in rest["data"]] == ["charge"] and rest["next_cursor"] is None

    missing = cli(project, "runs", "steps", "run_does_not_exist")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error[run_not_found]: Run run_does_not_exist does not exist in environment")
    assert "Traceback" not in missing.stderr
    missing_json = cli(project, "--json", "runs", "steps", "run_does_not_exist")
    assert missing_json.returncode == 1
    assert json.loads(missing_json.stderr)["error"]["code"] == "run_not_found"

    bad_cursor = cli(project, "runs", "steps", run_id, "--cursor", "garbage")
    assert bad_cursor.returncode == 1 and bad_cursor.stderr.startswith("error[validation_failed]:")
    assert cli(project, "runs", "steps", run_id, "--limit", "0").returncode == 2


async def test_the_steps_table_cuts_only_the_output_on_a_narrow_terminal():
    runtime, clock = make_runtime(flaky)
    async with runtime:
        run_id = await _retried_run(runtime, clock)
        page = await runtime.runs.steps(run_id)
    buffer = io.StringIO()
    Output(stdout=buffer, stderr=io.StringIO(), width=55).steps_table(run_id, page)
    lines = buffer.getvalue().splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["step", "attempt", "completed"],
        ["a-notify", "2", "2026-01-01T00:00:10.000Z"],
        ["b-reserve", "1", "2026-01-01T00:00:00.000Z"],
        ["charge", "1", "2026-01-01T00:00:00.000Z"],
        ["d-audit", "2", "2026-01-01T00:00:10.000Z"],
    ]
    assert all(len(line) <= 55 for line in lines) and lines[3].endswith("{\"charge…")

    empty = io.StringIO()
    Output(stdout=empty, stderr=io.StringIO(), width=100).steps_table("run_1", Page[RunStepRecord](data=[]))
    assert empty.getvalue() == "run_1 has no completed steps\n"


@task("steps.long_key")
async def long_key(payload: dict, ctx: TaskContext) -> None:
    await ctx.step.run("k" * 300, lambda token: {"note": "x" * 300})
    await ctx.step.run("short", lambda token: {"note": "y" * 300})


@pytest.mark.parametrize("width", [80, 120, 400])
async def test_the_steps_table_cuts_a_long_step_key_and_keeps_each_steps_attempt_and_time(width: int) -> None:
    """A step key longer than the line squeezed the attempt column to nothing, cut the completion time and
    dropped the output column, even piped (400 columns): only the output gave way, and once it had, Rich
    shrank every column alike. The key and the output now give way, cut with an ellipsis."""
    runtime, _ = make_runtime(long_key)
    async with runtime:
        run = await runtime.run_now(long_key, {})
        page = await runtime.runs.steps(run.id)
    buffer = io.StringIO()
    Output(stdout=buffer, stderr=io.StringIO(), width=width).steps_table(run.id, page)
    header, *rows = buffer.getvalue().splitlines()
    assert header.split() == ["step", "attempt", "completed", "output"]
    assert len(rows) == 2 and all(len(line.rstrip()) <= width for line in [header, *rows])
    for row, step in zip(rows, page.data):
        key, attempt, completed, output = row.split()
        assert attempt == "1" and completed == step.completed_at.isoformat(timespec="milliseconds")[:-6] + "Z"
        assert key.endswith("…") if len(step.step_key) > width // 2 else key == step.step_key
        assert output.startswith('{"note":"') and output.endswith("…")
