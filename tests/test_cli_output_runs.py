"""The line ``runlane work`` and ``runlane dev`` print for each executed run says what happens next."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime, timedelta

import pytest

from runlane import Retry, RunStatus, TaskContext, create_runlane, queue, task
from runlane.cli.output import Output, printable
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


async def test_the_attempts_table_says_what_each_released_attempt_waited_for() -> None:
    """`runlane runs attempts` showed nothing for an attempt that released without a reason: not whether it
    waited for a time, a signal (which key) or another run. Nor did the run.released line of `runs get
    --events` for a signal or run wait."""
    clock = ControlledClock()
    start = clock.now()
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[waits], clock=clock)
    attempts, events = io.StringIO(), io.StringIO()
    async with runtime:
        for payload in ({"kind": "time"}, {"kind": "signal"}, {"kind": "run", "run_id": "run_export"}):
            run = await runtime.run_now(waits, payload)
            Output(stdout=attempts, stderr=io.StringIO(), width=300).attempts_table(
                await runtime.runs.get(run.id), await runtime.runs.attempts(run.id)
            )
            Output(stdout=events, stderr=io.StringIO(), width=300).run_detail(run, await runtime.runs.events(run.id))
        worker = f"actor=worker:{runtime.worker_id}"
    assert [line.split("Z  ")[-1].strip() for line in attempts.getvalue().splitlines() if "released" in line] == [
        f"released resume_at={_at(start, 300)}",
        f"released waiting_for=signal:approved.q3 timeout_at={_at(start, 3600)}",
        "released waiting_for=run:run_export",
    ]
    assert [line.split("run.released  ")[-1] for line in events.getvalue().splitlines() if "run.released" in line] == [
        f"attempt=1 resume_at={_at(start, 300)} {worker}",
        f"attempt=1 waiting_for=signal:approved.q3 timeout_at={_at(start, 3600)} {worker}",
        f"attempt=1 waiting_for=run:run_export {worker}",
    ]


async def test_runs_get_says_in_words_what_a_released_run_waits_for() -> None:
    """The card of a released run printed its wait as raw JSON ({"type":"signal","signal_key":...})."""
    clock = ControlledClock()
    start = clock.now()
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[waits], clock=clock)
    card = io.StringIO()
    async with runtime:
        for payload in ({"kind": "time"}, {"kind": "signal"}, {"kind": "run", "run_id": "run_export"}):
            run = await runtime.run_now(waits, payload)
            Output(stdout=card, stderr=io.StringIO(), width=300).run_detail(run, None)
    lines = card.getvalue().splitlines()
    assert [line.split("waiting for")[-1].strip() for line in lines if "waiting for" in line] == [
        f"time until {_at(start, 300)}",
        f"signal approved.q3 (timeout {_at(start, 3600)})",
        "run run_export",
    ]


async def test_the_attempts_table_says_when_a_failed_attempt_is_retried() -> None:
    """A retried attempt showed its failure only, as the last one did: not that, and when, the run runs again."""
    clock = ControlledClock()
    start = clock.now()
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[fails], clock=clock)
    buffer = io.StringIO()
    async with runtime:
        run = (await runtime.trigger(fails, {})).run
        await runtime.execute_next()
        clock.advance("30s")
        await runtime.execute_next()
        Output(stdout=buffer, stderr=io.StringIO(), width=300).attempts_table(
            await runtime.runs.get(run.id), await runtime.runs.attempts(run.id)
        )
    details = [line.split("Z  ")[-1].strip() for line in buffer.getvalue().splitlines() if "task_failed" in line]
    assert details == [f"task_failed: Task failed. retry_at={_at(start, 30)}", "task_failed: Task failed."]


async def test_runs_get_of_a_running_run_names_its_lease_holder_and_attempt_deadline() -> None:
    """The card of a running run did not say which worker held it, until when (past it the worker is gone
    and tick() takes the run back), nor the attempt's deadline, which run.lease_claimed records."""
    import asyncio

    release = asyncio.Event()

    @task("bounded.by.deadline", max_attempt_duration="10m")
    async def bounded_by_deadline(payload: dict) -> None:
        await release.wait()

    clock = ControlledClock()
    start = clock.now()
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[bounded_by_deadline], clock=clock)
    buffer = io.StringIO()
    async with runtime:
        run = (await runtime.trigger(bounded_by_deadline, {})).run
        attempt = asyncio.ensure_future(runtime.execute_next(lease_duration="1m", worker_id="worker-7"))
        while (running := await runtime.runs.get(run.id)).status is not RunStatus.RUNNING:
            await asyncio.sleep(0.001)
        Output(stdout=buffer, stderr=io.StringIO(), width=300).run_detail(running, await runtime.runs.events(run.id))
        release.set()
        assert (await asyncio.wait_for(attempt, 10)).status is RunStatus.SUCCEEDED
    lines = buffer.getvalue().splitlines()
    assert [line.split()[1:] for line in lines if line.split()[:1] == ["lease"]] == [
        ["worker-7", "until", _at(start, 60)]
    ]
    assert any(line.split() == ["attempt", "deadline", _at(start, 600)] for line in lines)
    assert any("run.lease_claimed" in line and f"attempt_deadline_at={_at(start, 600)}" in line for line in lines)


async def test_runs_get_of_a_queued_bounded_run_says_whether_it_holds_a_dispatch_reservation() -> None:
    """Two queued runs of a full bounded queue printed the same card: not that one holds a slot (tick()
    reserved it, and it waits for a worker) until a time, while the other waits for tick() to reserve one."""
    single = queue("single", concurrency_limit=1, dispatch_timeout="2m")

    @task("bounded.dispatch", queue=single)
    async def bounded_dispatch(payload: dict) -> None:
        return None

    clock = ControlledClock()
    start = clock.now()
    runtime = create_runlane(lane=local_lane(), queues=[default, single], tasks=[bounded_dispatch], clock=clock)
    cards = []
    async with runtime:
        first = (await runtime.trigger(bounded_dispatch, {"n": 1})).run
        second = (await runtime.trigger(bounded_dispatch, {"n": 2})).run
        clock.advance("1s")
        assert (await runtime.tick()).dispatch_reserved == 1
        for run_id in (first.id, second.id):
            buffer = io.StringIO()
            Output(stdout=buffer, stderr=io.StringIO(), width=300).run_detail(
                await runtime.runs.get(run_id), await runtime.runs.events(run_id)
            )
            cards.append([line.split() for line in buffer.getvalue().splitlines()])
    reserved, waiting = cards
    assert ["dispatched", _at(start, 1)] in reserved and ["dispatch", "expires", _at(start, 121)] in reserved
    assert not any(line[:1] == ["dispatched"] or line[:2] == ["dispatch", "expires"] for line in waiting)


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
        output.attempts_table(done, await runtime.runs.attempts(done.id))
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
        output.attempts_table(failed, await runtime.runs.attempts(failed.id))
    # Handler messages are normalized when stored; the fields are kept.
    shown = "validation_failed: Task failed (validation_failed). (items[0].sku: Field required; payload: Too big)"
    assert buffer.getvalue().count(shown) == 3  # the run's failure, its run.failed event and its attempt


async def test_an_attempt_whose_worker_died_is_shown_as_having_no_outcome() -> None:
    """A later attempt started, so the earlier ``running`` one will never record an outcome."""
    import asyncio

    started: list[int] = []

    @task("native.flaky")
    async def flaky(payload: dict, ctx: TaskContext) -> str:
        started.append(ctx.attempt)
        if ctx.attempt == 1:
            await asyncio.sleep(3600)  # stands in for a worker killed mid-attempt
        return "done"

    clock = ControlledClock()
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[flaky], clock=clock)
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=300)
    async with runtime:
        run = (await runtime.trigger(flaky, {})).run
        killed = asyncio.ensure_future(runtime.execute_next(lease_duration="30s", heartbeat_interval="20s"))
        while not started:
            await asyncio.sleep(0.005)
        killed.cancel()
        await asyncio.gather(killed, return_exceptions=True)
        output.attempts_table(await runtime.runs.get(run.id), await runtime.runs.attempts(run.id))
        assert "no outcome" not in buffer.getvalue()  # the only attempt of a running run: it may still run
        clock.advance("31s")
        await runtime.tick()  # the lease expired: the run is due again, its attempt will never end
        recovered = await runtime.runs.get(run.id)
        assert recovered.status is RunStatus.QUEUED
        output.attempts_table(recovered, await runtime.runs.attempts(run.id))
        assert buffer.getvalue().count("no outcome: its worker stopped") == 1
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        attempts = await runtime.runs.attempts(run.id)
        assert [str(attempt.status) for attempt in attempts] == ["running", "succeeded"]
        output.attempts_table(await runtime.runs.get(run.id), attempts)
    rows = [line for line in buffer.getvalue().splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert "no outcome: its worker stopped (crashed, was killed, or lost the lease)" in rows[-2]
    assert "no outcome" not in rows[-1]


async def test_an_attempt_a_stopping_worker_interrupted_says_so() -> None:
    """Nobody cancelled the run, and it did not fail: its worker was stopping, so it was handed back."""
    import asyncio

    from runlane import WorkerMode

    started = asyncio.Event()

    @task("cooperative.stop", retry=Retry(3, backoff="1s"))
    async def cooperative(payload: dict, ctx: TaskContext) -> str:
        started.set()
        await ctx.signal.wait()
        ctx.signal.raise_if_aborted()
        return "done"

    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[cooperative], clock=ControlledClock())
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=300)
    async with runtime:
        run = (await runtime.trigger(cooperative, {})).run
        worker = runtime.worker(mode=WorkerMode.POLL)
        await asyncio.wait_for(started.wait(), 10)
        await worker.stop()
        output.attempts_table(await runtime.runs.get(run.id), await runtime.runs.attempts(run.id))
    assert "released: worker_stopped" in buffer.getvalue() and "operation_cancelled" not in buffer.getvalue()


async def test_a_signal_that_resumed_as_many_runs_as_its_limit_says_more_may_wait() -> None:
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[waits], clock=ControlledClock())
    human, machine = io.StringIO(), io.StringIO()
    async with runtime:
        for _ in range(3):
            await runtime.trigger(waits, {"kind": "signal"})
        while await runtime.execute_next() is not None:
            pass
        first = await runtime.signals.send("approved.q3", limit=2)
        Output(stdout=human, stderr=io.StringIO(), width=300).signal_result("approved.q3", first, 2)
        Output(stdout=machine, stderr=io.StringIO(), json_mode=True).signal_result("approved.q3", first, 2)
        rest = await runtime.signals.send("approved.q3", limit=2)
        Output(stdout=human, stderr=io.StringIO(), width=300).signal_result("approved.q3", rest, 2)
    text = human.getvalue()
    assert "✓ signal approved.q3 resumed 2 runs" in text and "✓ signal approved.q3 resumed 1 run" in text
    assert text.count("that is the limit (2): more runs may still wait; send it again") == 1
    assert json.loads(machine.getvalue())["more"] is True


@pytest.mark.parametrize("width", [80, 100, 120, 400])
async def test_runs_list_prints_one_line_per_run_at_any_width_with_generated_ids_whole(width: int) -> None:
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[fails], clock=ControlledClock())
    buffer = io.StringIO()
    async with runtime:
        long_id = "run_" + "x" * 300
        await runtime.trigger(fails, {}, run_id=long_id)
        generated = [(await runtime.trigger(fails, {})).run.id for _ in range(2)]
        Output(stdout=buffer, stderr=io.StringIO(), width=width).runs_table(await runtime.runs.list())
    header, *rows = buffer.getvalue().splitlines()
    assert len(rows) == 3 and all(line.split()[1] == "queued" for line in rows)  # one line each, status kept
    assert header.split()[:4] == ["id", "status", "task", "queue"] and "run at" in header
    for run_id in generated:  # a generated id is shown whole, to be copied
        assert any(line.startswith(run_id + " ") for line in rows)
    assert all(len(line) <= width for line in [header, *rows])
    long_row = next(line for line in rows if line.startswith("run_xxx"))
    assert (long_id in long_row) == (width == 400) and ("…" in long_row) == (width < 400)
    assert ("created" in header) == (width >= 120)


# Clears the screen, sets the window title, turns the rest red, returns to the line's start, forges a log line
# of its own, and reverses what follows (C1 CSI and a bidi override). No ':' (reserved in ids).
HOSTILE = "evil\x1b[2J\x1b]0;TITLE\x1b\\\x1b[31mRED\r\n2026-11-30T08 info all good\x9b\u202e"
ESCAPED = "evil\\x1b[2J\\x1b]0;TITLE\\x1b\\\\x1b[31mRED\\r\\n2026-11-30T08 info all good\\x9b\\u202e"
UNICODE = "café ✓ 日本"
RAW = ("\x1b", "\r", "\n2026-11-30T08 info", "\x9b", "\u202e")


def test_printable_escapes_control_characters_as_repr_does_and_keeps_unicode() -> None:
    unprintable = "\x00\x07\x08\t\n\r\x1b[2J\x7f\x85\x9b\u2028\u2029\u202e\u2066\ud800"
    assert printable(unprintable) == repr(unprintable)[1:-1]
    assert printable(HOSTILE) == ESCAPED
    for kept in (UNICODE, "[/] \\x1b 👨‍👩‍👧 שלום", ""):
        assert printable(kept) == kept


bounded = queue("bounded", concurrency_limit=5)


@task("echo.hostile", queue=bounded, retry=Retry(1))
async def echo_hostile(payload: dict, ctx: TaskContext) -> dict:
    if payload.get("fail"):
        raise RuntimeError(f"{HOSTILE} {UNICODE}")
    if payload.get("signal"):
        return ctx.wait_for_signal(HOSTILE)
    return payload


async def test_control_characters_in_runs_events_attempts_and_log_lines_are_printed_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ids, keys, reasons, actors, outputs and exception text are data: printed raw, an escape sequence in
    one would act on the operator's terminal and a newline would forge a line."""
    from runlane import Actor, ActorType

    clock = ControlledClock()
    runtime = create_runlane(lane=local_lane(), queues=[default, bounded], tasks=[echo_hostile], clock=clock)
    out, err = io.StringIO(), io.StringIO()
    output = Output(stdout=out, stderr=err, width=300)
    async with runtime:
        created = await runtime.trigger(
            echo_hostile,
            {"text": f"{HOSTILE} {UNICODE}"},
            run_id=f"ok-{HOSTILE}",
            idempotency_key=HOSTILE,
            concurrency_key=HOSTILE,
            meta={"note": HOSTILE},
        )
        output.trigger_result(created)
        output.trigger_result(await runtime.trigger(echo_hostile, {}, idempotency_key=HOSTILE))
        await runtime.trigger(echo_hostile, {"fail": True}, run_id=f"bad-{HOSTILE}")
        await runtime.trigger(echo_hostile, {"signal": True}, run_id=f"waits-{HOSTILE}")
        with caplog.at_level("WARNING", logger="runlane"):
            while (run := await runtime.execute_next()) is not None:
                output.run_executed(run)
        cancelled = (await runtime.trigger(echo_hostile, {}, run_id=f"cancelled-{HOSTILE}", singleton_key=HOSTILE)).run
        operator = Actor(type=ActorType.OPERATOR, id=HOSTILE)
        output.run_result(await runtime.runs.cancel(cancelled.id, reason=HOSTILE, actor=operator), verb="cancel")
        output.runs_table(await runtime.runs.list())
        for run_id in (f"ok-{HOSTILE}", f"bad-{HOSTILE}", f"waits-{HOSTILE}", cancelled.id):
            output.run_detail(await runtime.runs.get(run_id), await runtime.runs.events(run_id))
            output.attempts_table(await runtime.runs.get(run_id), await runtime.runs.attempts(run_id))
        output.signal_result(HOSTILE, [])
    (failed,) = [record for record in caplog.records if record.exc_info]
    output.log(failed)
    printed, logged = out.getvalue(), err.getvalue()
    for text in (printed, logged):
        assert not any(raw in text for raw in RAW), [raw for raw in RAW if raw in text]
    assert printed.count(f"ok-{ESCAPED}") >= 4  # trigger card, runs table, run card, attempts
    for key in ("idempotency key", "concurrency key", "singleton key"):
        assert re.search(f"\n  {key} +{re.escape(ESCAPED)}\n", printed), key
    # Payloads, outputs and meta are compact JSON, which escapes C0 controls its own way; the rest as above.
    in_json = printable(json.dumps(HOSTILE, ensure_ascii=False)[1:-1])
    assert printed.count(f'"text":"{in_json} {UNICODE}"') >= 3  # payload, output, the attempt's output
    assert f'"note":"{in_json}"' in printed
    assert f"waiting_for=signal:{ESCAPED}" in printed
    assert f"reason={ESCAPED}" in printed and f"actor=operator:{ESCAPED}" in printed
    assert f"✓ signal {ESCAPED} resumed 0 runs" in printed
    # The log line and the exception's own line in its traceback: one line each.
    assert f"error Run bad-{ESCAPED} (task echo.hostile): attempt 1 failed" in logged
    assert f"\nRuntimeError: {ESCAPED} {UNICODE}\n" in logged
    assert logged.splitlines()[-1] == f"RuntimeError: {ESCAPED} {UNICODE}"


def test_control_characters_in_errors_warnings_and_lifecycle_records_are_printed_escaped() -> None:
    from runlane import ErrorCode, RunlaneError

    out, err = io.StringIO(), io.StringIO()
    output = Output(stdout=out, stderr=err, width=300)
    output.error(RunlaneError(ErrorCode.RUN_NOT_FOUND, f"Run {HOSTILE!s} was not found."))
    output.warning("some_code", HOSTILE)
    output.warn(HOSTILE)
    output.record("command", f"command runs get ✗ run_not_found: {HOSTILE}")
    output.file_written(f"/tmp/{HOSTILE}", overwritten=False)
    for text in (out.getvalue(), err.getvalue()):
        assert not any(raw in text for raw in RAW), [raw for raw in RAW if raw in text]
    assert f"error[run_not_found]: Run {ESCAPED} was not found." in err.getvalue()
    assert f"warning: {ESCAPED}" in err.getvalue() and f"run_not_found: {ESCAPED}" in out.getvalue()

    json_out = io.StringIO()
    Output(json_mode=True, stdout=json_out, stderr=json_out).record("command", "x", summary=HOSTILE)
    assert "\\u001b[2J" in json_out.getvalue()  # JSON escapes control characters its own way, as before


async def test_an_interrupted_prune_all_says_how_many_runs_it_had_already_pruned(capsys) -> None:
    import asyncio
    from types import SimpleNamespace

    from runlane.cli.main import build_app

    build_app()  # the command modules, imported in their order
    from runlane.cli.actions import PruneParams, _prune
    from runlane.core.pruning import PruneResult

    calls = {"n": 0}

    async def prune(**options):
        calls["n"] += 1
        if calls["n"] == 3:
            raise asyncio.CancelledError  # Ctrl-C while the third page is pruned
        return PruneResult(pruned=50, next_cursor=f"cursor-{calls['n']}")

    runtime = SimpleNamespace(runs=SimpleNamespace(prune=prune))
    params = PruneParams(older_than="30d", all_pages=True)
    with pytest.raises(asyncio.CancelledError):
        await _prune(runtime, params)
    expected = "interrupted: 100 runs pruned before the interruption; continue with --cursor cursor-2\n"
    assert capsys.readouterr().err == expected


@task("echoes")
async def echoes(payload: dict) -> dict:
    return payload


async def test_runs_attempts_cuts_a_long_detail_and_keeps_every_other_column_whole() -> None:
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[echoes], clock=ControlledClock())
    buffer = io.StringIO()
    output = Output(stdout=buffer, stderr=io.StringIO(), width=100)
    async with runtime:
        run = (await runtime.trigger(echoes, {"message": "imported " + "x" * 300})).run
        await runtime.execute_next()
        output.attempts_table(await runtime.runs.get(run.id), await runtime.runs.attempts(run.id))
    header, row = buffer.getvalue().splitlines()[:2]
    assert header.split() == ["attempt", "status", "started", "completed", "detail"]
    assert row.split()[:2] == ["1", "succeeded"] and len(row.split()[2]) == len("2026-01-01T00:00:00.000Z")
    assert row.rstrip().endswith("…") and all(len(line) <= 100 for line in buffer.getvalue().splitlines())


async def test_json_output_escapes_what_a_terminal_acts_on_that_json_leaves_as_it_is() -> None:
    """JSON escapes C0 controls, not DEL, C1 controls (\\x9b starts a control sequence, like ESC [) or bidi
    controls: --json output and the console exporter escape those too, and stay the same JSON."""
    from runlane import ConsoleObservationSink
    from runlane.json_values import terminal_safe_json

    hostile = {"text": "x\x9b31m\u202eevil\x7f\u2028ok é 😀"}
    buffer = io.StringIO()
    Output(json_mode=True, stdout=buffer, stderr=io.StringIO()).emit_json(hostile)
    written = buffer.getvalue()
    assert re.search(r"[\x7f-\x9f\u202e\u2028]", written) is None
    assert "\\u009b" in written and "\\u202e" in written and "é 😀" in written  # the rest as it is
    assert json.loads(written) == hostile
    assert json.loads(terminal_safe_json(json.dumps(hostile, ensure_ascii=False))) == hostile
    # The console exporter's lines: a trace carrier value is the producer's text.
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[echoes], clock=ControlledClock())
    lines = io.StringIO()
    async with runtime:
        await runtime.trigger(echoes, {}, trace_carrier={"tracestate": "vendor=\x9b2J\u202e"})
        await runtime.observation_exporter("console", ConsoleObservationSink(lines)).export_once()
    assert lines.getvalue() and re.search(r"[\x7f-\x9f\u202e]", lines.getvalue()) is None
    record = json.loads(lines.getvalue().splitlines()[0])
    assert record["observation"]["trace_carrier"] == {"tracestate": "vendor=\x9b2J\u202e"}


@pytest.mark.parametrize("width", [100, 130])
async def test_the_queues_table_cuts_a_long_queue_name_and_keeps_every_count(width: int) -> None:
    """A queue name longer than the line left no room for the counts: the name's column was the only one
    that could not shrink, so every count column was squeezed to nothing and `runlane queues` showed names
    only, even piped. The name is cut with an ellipsis instead."""
    from runlane.cli.queues import queue_overview

    long_queue = queue("q" * 200)
    runtime = create_runlane(lane=local_lane(), queues=[default, long_queue], tasks=[fails])
    buffer = io.StringIO()
    async with runtime:
        await runtime.trigger(fails, {}, queue=long_queue)
        Output(stdout=buffer, stderr=io.StringIO(), width=width).queues_table(await queue_overview(runtime))
    lines = buffer.getvalue().splitlines()
    assert all(len(line.rstrip()) <= width for line in lines)
    *_, default_row, long_row = lines
    assert default_row.split()[:4] == ["default", "(default)", "-", "0"]
    name, limit, *counts = long_row.split()
    assert name.startswith("qqq") and name.endswith("…") and limit == "-"
    assert counts == ["0", "1", "0", "0", "0", "0"]  # scheduled, queued (the run), running, ...
