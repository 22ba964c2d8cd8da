"""The line ``runlane work`` and ``runlane dev`` print for each executed run says what happens next."""

from __future__ import annotations

import io
from datetime import datetime, timedelta

from runlane import Retry, RunStatus, TaskContext, create_runlane, queue, task
from runlane.cli.output import Output
from runlane.testing import ControlledClock
from runlane_local import local_lane

default = queue("default", default=True)


@task("waits")
async def waits(payload: dict, ctx: TaskContext):
    kind = payload["kind"]
    if kind == "time":
        return ctx.release("5m")
    if kind == "signal":
        return ctx.wait_for_signal("approved.q3", timeout="1h")
    return ctx.wait_for_run(payload["run_id"])


@task("fails", retry=Retry(2, backoff="30s"))
async def fails(payload: dict) -> None:
    raise RuntimeError("down")


async def test_each_executed_run_line_says_why_and_what_next() -> None:
    clock = ControlledClock()
    start = clock.now()
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[waits, fails], clock=clock)
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=300)
    async with runtime:
        other = (await runtime.trigger(fails, {})).run.id
        for payload in ({"kind": "time"}, {"kind": "signal"}, {"kind": "run", "run_id": other}):
            await runtime.trigger(waits, payload)
        while (run := await runtime.execute_next()) is not None:
            output.run_executed(run)
        clock.advance("30s")
        failed = await runtime.execute_next()
        assert failed is not None and failed.status is RunStatus.FAILED
        output.run_executed(failed)
    lines = buffer.getvalue().splitlines()
    expected = [
        f" run retrying {other} task=fails queue=default attempts=1 error=task_failed retry_at={_at(start, 30)}",
        f" task=waits queue=default attempts=1 resume_at={_at(start, 300)}",
        f" task=waits queue=default attempts=1 waiting_for=signal:approved.q3 timeout_at={_at(start, 3600)}",
        f" task=waits queue=default attempts=1 waiting_for=run:{other}",
        f" run failed {other} task=fails queue=default attempts=2 error=task_failed",
    ]
    # The same due time: the first four run in any order; the retry comes last.
    assert sorted(next(i for i, end in enumerate(expected) if end in line) for line in lines[:4]) == [0, 1, 2, 3]
    assert all(line.endswith(end) for line in lines for end in expected if end in line)
    assert lines[4].endswith(expected[4])


def _at(start: datetime, seconds: int) -> str:
    return (start + timedelta(seconds=seconds)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def test_brackets_in_ids_reasons_and_outputs_are_printed_as_they_are() -> None:
    """Console output is never read as markup: "[/]" in an id crashed `runlane runs list`."""

    @task("echo.bracketed")
    async def echo(payload: dict) -> dict:
        return payload

    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[echo], clock=ControlledClock())
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=300)
    async with runtime:
        await runtime.trigger(echo, {"title": "Q3 [draft] [red]v2"}, run_id="imp[/]2026-11")
        done = await runtime.execute_next()
        cancelled = (await runtime.trigger(echo, {}, run_id="dup[/]x")).run
        cancelled = await runtime.runs.cancel(cancelled.id, reason="duplicate of [/]orders [bold]x")
        output.runs_table(await runtime.runs.list())
        output.run_detail(done, await runtime.runs.events(done.id))
        output.run_detail(cancelled, await runtime.runs.events(cancelled.id))
        output.attempts_table(done.id, await runtime.runs.attempts(done.id))
    printed = buffer.getvalue()
    for shown in ("imp[/]2026-11", "dup[/]x", '"Q3 [draft] [red]v2"', "duplicate of [/]orders [bold]x"):
        assert shown in printed, shown


async def test_a_validation_failure_shows_which_fields_failed_without_json() -> None:
    """The stored failure message is the same for every payload; the fields come from ``meta.errors``."""
    from runlane import ErrorCode, RunlaneError

    @task("orders.import")
    async def import_order(payload: dict) -> None:
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED,
            "Order rejected.",
            meta={"errors": [{"loc": ["items", 0, "sku"], "msg": "Field required"}, {"loc": [], "msg": "Too big"}]},
        )

    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[import_order], clock=ControlledClock())
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=300)
    async with runtime:
        await runtime.trigger(import_order, {})
        failed = await runtime.execute_next()
        assert failed is not None and failed.status is RunStatus.FAILED
        output.run_detail(failed, await runtime.runs.events(failed.id))
        output.attempts_table(failed.id, await runtime.runs.attempts(failed.id))
    # Handler messages are normalized when stored; the fields are kept.
    shown = "validation_failed: Task failed (validation_failed). (items[0].sku: Field required; payload: Too big)"
    assert buffer.getvalue().count(shown) == 3  # the run's failure, its run.failed event and its attempt
