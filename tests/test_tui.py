"""The dashboard (``runlane tui``), driven with Textual's pilot over a real in-memory runtime.

Every test builds the app over ``DashboardClient.local(runtime)``: the same operations and JSON as the
``runlane`` commands. Times come from a ``ControlledClock`` and run ids are fixed, so the SVG snapshots
of the main screens are stable; behaviour tests assert on the widgets and on the runtime itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from runlane_local import local_lane
from textual.geometry import Region

from runlane import ErrorCode, Retry, RunlaneError, RunStatus, TaskContext, create_runlane, queue, task
from runlane.cli.output import printable
from runlane.testing import ControlledClock
from runlane.tui import DashboardClient, RunlaneDashboard
from runlane.tui.screens.confirm import ConfirmScreen
from runlane.tui.screens.run_detail import RunDetailScreen
from runlane.tui.screens.runs import RunsScreen
from runlane.tui.widgets.runs_table import RunsTable

T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
SIZE = (140, 36)

default = queue("default", default=True)
reports = queue("reports", concurrency_limit=2)


@task("emails.send")
async def send(payload: dict[str, Any]) -> dict[str, Any]:
    return {"sent": payload["to"]}


@task("imports.run", retry=Retry(max_attempts=1))
async def import_file(payload: dict[str, Any]) -> None:
    raise RuntimeError("the file is gone")


@task("approvals.wait")
async def wait_for_approval(payload: dict[str, Any], ctx: TaskContext) -> Any:
    return ctx.wait_for_signal(f"approved.{payload['id']}")


@task("reports.build", queue=reports)
async def build_report(payload: dict[str, Any]) -> None:
    return None


def make_runtime() -> Any:
    clock = ControlledClock(T0)
    return create_runlane(
        lane=local_lane(),
        queues=[default, reports],
        tasks=[send, import_file, wait_for_approval, build_report],
        clock=clock,
        worker_id="worker_tui_test",
    )


async def seed(runtime: Any) -> None:
    """Two sent emails, a failed import, a run waiting for a signal, and a report waiting for capacity,
    created a second apart in that order."""
    for task_definition, payload, run_id in (
        (send, {"to": "ada"}, "run_email_ada"),
        (send, {"to": "bob"}, "run_email_bob"),
        (import_file, {"file": "q3.csv"}, "run_import_q3"),
        (wait_for_approval, {"id": "po-7"}, "run_approval_po7"),
    ):
        await runtime.trigger(task_definition, payload, run_id=run_id)
        runtime.clock.advance(timedelta(seconds=1))
    for _ in range(4):
        await runtime.execute_next()
    await runtime.trigger(build_report, {"month": "11"}, run_id="run_report_nov")


async def settle(pilot: Any) -> None:
    """Let the screen's loading workers finish and the screen repaint."""
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def rows(app: Any, table: str) -> list[list[str]]:
    widget = app.screen.query_one(f"#{table}")
    return [[str(cell) for cell in widget.get_row_at(index)] for index in range(widget.row_count)]


def run_ids(app: Any) -> list[str]:
    return [row[0] for row in rows(app, "runs")]


def status_line(app: Any) -> str:
    return str(app.screen.query_one("#status-line").render())


REFRESHED = "  ·  refreshed 08:00:04 UTC"  # the seeded runtime's clock, which the dashboard tells the time by


@asynccontextmanager
async def dashboard(*, refresh_interval: float = 0) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A seeded runtime and the dashboard over it, running under the pilot: ``(app, pilot, runtime)``."""
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        app = RunlaneDashboard(
            DashboardClient.local(runtime), refresh_interval=refresh_interval, now=runtime.clock.now
        )
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            yield app, pilot, runtime


# ---------------------------------------------------------------------------------------------
# The runs screen


async def test_the_runs_screen_shows_the_newest_runs_and_the_queue_overview() -> None:
    async with dashboard() as (app, pilot, runtime):
        assert isinstance(app.screen, RunsScreen)
        assert run_ids(app) == [
            "run_report_nov", "run_approval_po7", "run_import_q3", "run_email_bob", "run_email_ada"
        ]  # fmt: skip
        statuses = {row[0]: row[1] for row in rows(app, "runs")}
        assert statuses == {
            "run_report_nov": "queued",
            "run_approval_po7": "released",
            "run_import_q3": "failed",
            "run_email_bob": "succeeded",
            "run_email_ada": "succeeded",
        }
        details = {row[0]: row[6] for row in rows(app, "runs")}
        assert details["run_import_q3"] == "task_failed: Task failed."
        assert details["run_approval_po7"] == "waiting for signal approved.po-7"
        queues = {row[0]: row for row in rows(app, "queues")}
        assert queues["default (default)"][1:] == ["-", "0", "0", "0", "0", "1", "0"]
        assert queues["reports"][1:] == ["2", "0", "1", "0", "0", "0", "0"]
        assert app.sub_title == "default · lane local · via this process"


async def test_text_status_and_queue_filters_narrow_the_runs() -> None:
    async with dashboard() as (app, pilot, runtime):
        await pilot.press("slash", *"email")
        await settle(pilot)
        assert run_ids(app) == ["run_email_bob", "run_email_ada"]
        assert status_line(app) == "2 of the newest 5 runs" + REFRESHED

        await pilot.press("enter", "s")  # back to the table, then status: active
        await settle(pilot)
        assert run_ids(app) == []  # active runs whose id, task or queue contains "email": none
        await pilot.press("escape")
        await settle(pilot)
        assert len(run_ids(app)) == 5

        await pilot.press("s", "s")  # status: failed
        await settle(pilot)
        assert run_ids(app) == ["run_import_q3"]
        assert "status: failed" in str(app.screen.query_one("#status-filter").render())
        await pilot.press("escape")

        app.screen.query_one("#queues").focus()
        await pilot.press("down", "enter")  # the second queue row: reports
        await settle(pilot)
        assert run_ids(app) == ["run_report_nov"]
        assert "queue: reports" in str(app.screen.query_one("#status-filter").render())
        await pilot.press("enter")  # the same queue again clears the queue filter
        await settle(pilot)
        assert len(run_ids(app)) == 5


async def test_the_status_filter_offers_every_active_status_the_queue_overview_counts() -> None:
    """The queue overview counts scheduled and cancelling runs: the status filter lists each of them alone,
    so that runs stuck being cancelled are not lost among the thousands already cancelled."""
    may_finish = asyncio.Event()

    @task("exports.hold")
    async def hold(payload: dict[str, Any]) -> None:
        await may_finish.wait()

    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[send, hold], clock=ControlledClock(T0))
    async with runtime:
        await runtime.trigger(send, {"to": "ada"}, run_id="run_email_ada")
        await runtime.runs.cancel("run_email_ada")
        await runtime.trigger(hold, {}, run_id="run_hold")
        running = asyncio.ensure_future(runtime.execute_next())
        try:
            for _ in range(500):
                if (await runtime.runs.get("run_hold")).status is RunStatus.RUNNING:
                    break
                await asyncio.sleep(0.01)
            await runtime.runs.cancel("run_hold")  # a cancellation requested of a running attempt
            local = DashboardClient.local(runtime)
            asked: list[Any] = []

            async def call(name: str, params: dict[str, Any]) -> str:
                if name == "runs list":
                    asked.append(params["status"])
                return await local._call(name, params)

            client = DashboardClient(call, lane=local.lane, environment=local.environment, where=local.where)
            app = RunlaneDashboard(client, refresh_interval=0, now=runtime.clock.now)
            async with app.run_test(size=SIZE) as pilot:
                await settle(pilot)
                listed: dict[str, list[str]] = {}
                for _ in range(20):
                    await pilot.press("s")
                    await settle(pilot)
                    name = filter_label(app).removeprefix("status: ")
                    if name == "all":
                        break
                    listed[name] = run_ids(app)
                assert {"scheduled", "cancelling"} <= set(listed)
                assert listed["cancelling"] == ["run_hold"]
                assert ["scheduled"] in asked and ["cancellation_requested"] in asked
        finally:
            may_finish.set()
            await asyncio.wait_for(running, timeout=5)


async def test_a_delayed_run_says_when_it_runs_and_a_due_one_says_nothing() -> None:
    """A delayed trigger is queued with a later ``run_at``: without it the row reads as work that should be
    running already (``runlane runs list`` shows it in its run at column)."""
    async with dashboard() as (app, pilot, runtime):
        await runtime.trigger(send, {"to": "cy"}, run_id="run_email_cy", delay="1h")
        await pilot.press("r")
        await settle(pilot)
        details = {row[0]: (row[1], row[6]) for row in rows(app, "runs")}
        assert details["run_email_cy"] == ("queued", "runs at 2026-11-30 09:00:04 UTC")
        assert details["run_report_nov"] == ("queued", "")  # due when it was created


async def test_brackets_page_through_older_and_newer_runs() -> None:
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        app = RunlaneDashboard(
            DashboardClient.local(runtime), refresh_interval=0, page_size=2, now=runtime.clock.now
        )
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert run_ids(app) == ["run_report_nov", "run_approval_po7"]
            assert status_line(app) == "the newest 2 runs  (] older)" + REFRESHED
            await pilot.press("right_square_bracket")
            await settle(pilot)
            assert run_ids(app) == ["run_import_q3", "run_email_bob"]
            assert status_line(app) == "2 runs on page 2  (] older, [ newer)" + REFRESHED
            await pilot.press("right_square_bracket")
            await settle(pilot)
            assert run_ids(app) == ["run_email_ada"]
            await pilot.press("right_square_bracket")  # no older page: stays
            await settle(pilot)
            assert status_line(app) == "1 run on page 3  ([ newer)" + REFRESHED
            await pilot.press("left_square_bracket")
            await settle(pilot)
            assert run_ids(app) == ["run_import_q3", "run_email_bob"]
            await pilot.press("s")  # a new filter starts from the newest page again
            await settle(pilot)
            assert run_ids(app) == ["run_report_nov", "run_approval_po7"]


async def test_the_runs_table_refreshes_itself_and_keeps_the_cursor_on_its_run() -> None:
    async with dashboard(refresh_interval=0.05) as (app, pilot, runtime):
        await pilot.press("down", "down")
        table = app.screen.query_one("#runs")
        assert table.cursor_key == "run_import_q3"
        runtime.clock.advance(timedelta(seconds=1))
        await runtime.trigger(send, {"to": "cy"}, run_id="run_email_cy")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if "run_email_cy" in run_ids(app):
                break
        assert run_ids(app)[0] == "run_email_cy"
        assert table.cursor_key == "run_import_q3"


async def test_rows_wider_than_the_columns_are_shown_whole_after_a_repaint_came_before_they_were_measured() -> None:
    # A table measures the rows it was given when it is next idle: on a busy machine the screen can be painted
    # before that, and those lines, cut to the old column widths, stayed on screen (as did the header).
    async with dashboard() as (app, pilot, runtime):
        table = app.screen.query_one("#runs", RunsTable)
        long_id = "run_" + "x" * 40
        runtime.clock.advance(timedelta(seconds=1))
        await runtime.trigger(send, {"to": "cy"}, run_id=long_id)
        show = table.show

        def show_then_repaint(runs: Any) -> None:
            show(runs)
            table.render_lines(Region(0, 0, table.size.width, table.size.height))

        table.show = show_then_repaint  # type: ignore[method-assign]
        await pilot.press("r")
        await settle(pilot)
        header, first = ("".join(segment.text for segment in table.render_line(y)) for y in (0, 1))
        assert long_id in first
        assert header.index("status") == first.index("queued")


# ---------------------------------------------------------------------------------------------
# A run's detail and the operator actions


async def open_run(pilot: Any, run_id: str) -> None:
    """Open ``run_id`` from the runs table and wait (bounded) until its screen shows what it read: on a
    busy machine the key, the screen push and its first read may each take a few event-loop turns."""
    await settle(pilot)
    table = pilot.app.screen.query_one("#runs")
    table.move_cursor(row=table.get_row_index(run_id))
    await pilot.press("enter")
    for _ in range(200):
        await settle(pilot)
        screen = pilot.app.screen
        if isinstance(screen, RunDetailScreen) and screen.run_id == run_id and screen.detail is not None:
            if not screen.reading:
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the screen of {run_id} did not show its run within 2 s (now {pilot.app.screen!r})")


async def test_enter_opens_the_run_with_its_attempts_and_event_timeline() -> None:
    async with dashboard() as (app, pilot, runtime):
        await open_run(pilot, "run_import_q3")
        assert isinstance(app.screen, RunDetailScreen) and app.screen.run_id == "run_import_q3"
        events = [row[2] for row in rows(app, "events")]
        assert events == [
            "run.created", "run.delivery_requested", "run.lease_claimed", "run.started", "run.failed"
        ]  # fmt: skip
        (attempt,) = rows(app, "attempts")
        assert attempt[:2] == ["1", "failed"] and attempt[4] == "task_failed: Task failed."
        assert status_line(app) == "1 attempts, 5 events" + REFRESHED
        await pilot.press("escape")
        await settle(pilot)
        assert isinstance(app.screen, RunsScreen)


async def test_an_attempt_whose_worker_died_shows_that_it_recorded_no_outcome() -> None:
    calls: list[int] = []

    @task("native.flaky")
    async def flaky(payload: dict[str, Any], ctx: TaskContext) -> str:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            await asyncio.sleep(3600)  # stands in for a worker killed mid-attempt
        return "done"

    clock = ControlledClock(T0)
    runtime = create_runlane(lane=local_lane(), queues=[default, reports], tasks=[flaky], clock=clock)
    async with runtime:
        await runtime.trigger(flaky, {}, run_id="run_flaky")
        killed = asyncio.ensure_future(runtime.execute_next(lease_duration="30s", heartbeat_interval="20s"))
        while not calls:
            await asyncio.sleep(0.005)
        killed.cancel()
        await asyncio.gather(killed, return_exceptions=True)
        clock.advance("31s")
        assert (await runtime.execute_next()).status == "succeeded"
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0, now=clock.now)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await open_run(pilot, "run_flaky")
            first, second = rows(app, "attempts")
            assert first[1] == "running" and first[4].startswith("no outcome: its worker stopped")
            assert second[1] == "succeeded" and "no outcome" not in second[4]


async def test_brackets_in_ids_outputs_and_reasons_are_shown_as_they_are() -> None:
    """Ids, outputs and reasons are data: "[/]" or "[red]" in them is shown, never read as markup."""
    runtime = make_runtime()
    async with runtime:
        await runtime.trigger(send, {"to": "q3 [draft] [red]v2"}, run_id="imp[/]2026-11")
        await runtime.execute_next()
        cancelled = (await runtime.trigger(send, {"to": "x"}, run_id="dup[/]x")).run
        await runtime.runs.cancel(cancelled.id, reason="duplicate of [/]orders")
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert sorted(run_ids(app)) == ["dup[/]x", "imp[/]2026-11"]
            await open_run(pilot, "imp[/]2026-11")
            (attempt,) = rows(app, "attempts")
            assert attempt[4] == 'output {"sent":"q3 [draft] [red]v2"}'
            await pilot.press("escape")
            await open_run(pilot, "dup[/]x")
            assert any("duplicate of [/]orders" in row[3] for row in rows(app, "events"))


# Clears the screen, sets the window title, turns the rest red, forges a line, reverses what follows.
HOSTILE = "evil\x1b[2J\x1b]0;TITLE\x1b\\\x1b[31mRED\r\n2026-11-30T08 info\x9b\u202e"
ESCAPED = "evil\\x1b[2J\\x1b]0;TITLE\\x1b\\\\x1b[31mRED\\r\\n2026-11-30T08 info\\x9b\\u202e"


def widget_lines(widget: Any) -> list[str]:
    strips = widget.render_lines(Region(0, 0, widget.outer_size.width, widget.outer_size.height))
    return ["".join(segment.text for segment in strip).rstrip() for strip in strips]


async def test_control_characters_in_ids_outputs_keys_and_reasons_are_shown_escaped() -> None:
    """Ids, keys, reasons and outputs are data: an escape sequence or a newline in them is shown escaped,
    never sent to the terminal; other Unicode is shown as it is."""
    unicode = "café ✓ 日本"
    runtime = make_runtime()
    async with runtime:
        await runtime.trigger(send, {"to": f"{HOSTILE} {unicode}"}, run_id=f"sent-{HOSTILE}", idempotency_key=HOSTILE)
        await runtime.trigger(wait_for_approval, {"id": HOSTILE}, run_id=f"waits-{HOSTILE}")
        await runtime.execute_next()
        await runtime.execute_next()
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            shown = [cell for row in rows(app, "runs") for cell in row]
            assert f"sent-{ESCAPED}" in shown and f"waiting for signal approved.{ESCAPED}" in shown

            await open_run(pilot, f"sent-{HOSTILE}")
            (attempt,) = rows(app, "attempts")
            assert attempt[4] == f'output {{"sent":"{_in_json(HOSTILE)} {unicode}"}}'
            card = widget_lines(app.screen.query_one("#card"))
            fields = {label: value.strip() for label, _, value in (line.strip().partition("  ") for line in card)}
            assert fields["run"] == f"sent-{ESCAPED}" and fields["idempotency key"] == ESCAPED
            shown += attempt + card + [cell for row in rows(app, "events") for cell in row]

            await pilot.press("escape")
            await open_run(pilot, f"waits-{HOSTILE}")
            await pilot.press("c")
            await pilot.pause()
            question = widget_lines(app.screen.query_one("#question"))
            assert str(app.screen.query_one("#question").render()).startswith(f"Cancel run waits-{ESCAPED}?")
            await pilot.press("y")
            await settle(pilot)
            assert (await runtime.runs.get(f"waits-{HOSTILE}")).status is RunStatus.CANCELLED
            notified = [notification.message for notification in app._notifications]
            assert f"Cancel recorded for waits-{ESCAPED}: it is cancelled." in notified
            shown += question + notified + [cell for row in rows(app, "events") for cell in row]
            shown += widget_lines(app.screen.query_one("#card"))
    for raw in ("\x1b", "\r", "\n", "\x9b", "\u202e"):
        assert not any(raw in text for text in shown), raw


async def test_the_run_card_shows_a_long_payload_and_output_whole() -> None:
    @task("orders.sync")
    async def sync(payload: dict[str, Any]) -> dict[str, Any]:
        return {"synced": payload["ids"], "cursor": "END-OF-OUTPUT", "note": "x" * 300}

    ids = [f"order-{number}" for number in range(60)]
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[sync], clock=ControlledClock(T0))
    async with runtime:
        payload = {"ids": ids, "tail": f"{HOSTILE} END-OF-PAYLOAD"}
        await runtime.trigger(sync, payload, run_id="run_sync")
        await runtime.execute_next()
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0)
        async with app.run_test(size=(100, 40)) as pilot:
            await open_run(pilot, "run_sync")
            card = widget_lines(app.screen.query_one("#card"))
    text = " ".join(line.strip() for line in card)
    assert "…" not in text
    assert all(f'"{item}"' in text for item in ids)
    assert f'"tail": "{_in_json(HOSTILE)} END-OF-PAYLOAD"' in text
    assert '"cursor": "END-OF-OUTPUT"' in text
    assert "x" * 300 in "".join(line.strip() for line in card)  # folded over lines, never cut
    assert max(len(line) for line in card) <= 100
    for raw in ("\x1b", "\r", "\x9b", "\u202e"):
        assert not any(raw in line for line in card), raw


async def test_the_run_card_shows_the_start_of_a_huge_payload_and_says_how_to_see_it_all() -> None:
    """A 200 KB payload laid out whole made every scroll step of the detail screen take most of a second."""
    from runlane.tui.widgets.run_card import SHOWN_CHARACTERS

    @task("blobs.store")
    async def store(payload: dict[str, Any]) -> None:
        return None

    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[store], clock=ControlledClock(T0))
    async with runtime:
        await runtime.trigger(store, {"blob": "START" + "y" * 200_000 + "END-OF-BLOB"}, run_id="run_big")
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0)
        async with app.run_test(size=(100, 40)) as pilot:
            await open_run(pilot, "run_big")
            card = widget_lines(app.screen.query_one("#card"))
    text = "".join(line.strip() for line in card)
    assert "START" in text and "END-OF-BLOB" not in text
    assert len(text) < SHOWN_CHARACTERS + 2_000
    note = re.search(r"… ([\d,]+) more characters: runlane runs get run_big --json prints all of it", " ".join(card))
    assert note is not None and 180_000 < int(note.group(1).replace(",", "")) < 180_100


def _in_json(text: str) -> str:
    """``text`` as compact JSON shows it, made printable."""
    return printable(json.dumps(text, ensure_ascii=False)[1:-1])


async def test_a_long_history_shows_its_newest_events_and_counts_the_earlier_ones() -> None:
    @task("polls.export")
    async def poll(payload: dict[str, Any], ctx: TaskContext) -> Any:
        return "done" if ctx.attempt == 40 else ctx.release("1s")  # claimed, started, released: 3 events

    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[poll], clock=ControlledClock(T0))
    async with runtime:
        run = (await runtime.trigger(poll, {}, run_id="run_long_poll")).run
        while (done := await runtime.execute_next()) is not None and done.status is not RunStatus.SUCCEEDED:
            runtime.clock.advance(timedelta(seconds=1))
        assert done.status is RunStatus.SUCCEEDED and done.event_sequence == 122
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0, now=runtime.clock.now)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await open_run(pilot, run.id)
            shown = rows(app, "events")
            assert [row[0] for row in shown] == [str(sequence) for sequence in range(23, 123)]
            assert shown[-1][2] == "run.succeeded"  # the outcome is on screen
            assert status_line(app) == (
                "40 attempts, 122 events (the newest 100; the 22 before: runlane runs get run_long_poll --events)"
                "  ·  refreshed 08:00:39 UTC"
            )


async def test_cancel_asks_first_and_keeping_the_run_changes_nothing() -> None:
    async with dashboard() as (app, pilot, runtime):
        await open_run(pilot, "run_approval_po7")
        await pilot.press("c")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        assert "Cancel run run_approval_po7?" in str(app.screen.query_one("#question").render())
        await pilot.press("n")
        await settle(pilot)
        assert isinstance(app.screen, RunDetailScreen)
        assert (await runtime.runs.get("run_approval_po7")).status is RunStatus.RELEASED

        await pilot.press("c", "y")
        await settle(pilot)
        assert (await runtime.runs.get("run_approval_po7")).status is RunStatus.CANCELLED
        assert app.screen.detail.run.status is RunStatus.CANCELLED  # the screen reloaded the run
        assert any("Cancel recorded for run_approval_po7" in n.message for n in app._notifications)
        events = await runtime.runs.events("run_approval_po7")
        assert events.data[-1].event.actor.id == "dashboard"


async def test_retry_creates_a_new_run_and_opens_it() -> None:
    async with dashboard() as (app, pilot, runtime):
        await open_run(pilot, "run_import_q3")
        await pilot.press("t", "y")
        await settle(pilot)
        assert isinstance(app.screen, RunDetailScreen)
        created = app.screen.run_id
        assert created != "run_import_q3"
        run = await runtime.runs.get(created)
        assert run.source.source_run_id == "run_import_q3" and run.payload == {"file": "q3.csv"}
        await pilot.press("escape")
        await settle(pilot)
        assert created in run_ids(app)


async def test_a_refused_action_shows_its_error_and_changes_nothing() -> None:
    async with dashboard() as (app, pilot, runtime):
        await open_run(pilot, "run_approval_po7")
        await runtime.runs.cancel("run_approval_po7")  # cancelled elsewhere while the screen shows it waiting
        await pilot.press("c", "y")
        await settle(pilot)
        assert isinstance(app.screen, RunDetailScreen) and app.screen.run_id == "run_approval_po7"
        (notification,) = app._notifications
        assert notification.severity == "error"
        assert notification.title == "cancel refused: validation_failed"
        assert "terminal runs cannot be cancelled" in notification.message
        page = await runtime.runs.list()
        assert len(page.data) == 5


async def test_an_action_whose_answer_was_lost_is_not_called_refused() -> None:
    """Storage that stops answering may have recorded the action first: the rerun below was created. Saying
    it was refused would have the operator rerun again, creating a second new run."""
    async with dashboard() as (app, pilot, runtime):
        client = app.client
        rerun = client.rerun

        async def answer_lost(run_id: str) -> Any:
            await rerun(run_id)
            raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "The connection to Postgres was lost.", retryable=True)

        client.rerun = answer_lost
        await open_run(pilot, "run_email_ada")
        await pilot.press("n", "y")
        await settle(pilot)
        (notification,) = app._notifications
        assert notification.severity == "error"
        assert notification.title == "rerun not confirmed: storage_unavailable"
        assert notification.message.startswith("The connection to Postgres was lost. It may have been recorded")
        assert "check the run (r refreshes) before trying again" in notification.message
        children = (await runtime.runs.list(source_run_id="run_email_ada")).data
        assert len(children) == 1


@pytest.mark.parametrize(
    ("run_id", "offered"),
    [
        ("run_email_ada", {"rerun"}),  # succeeded
        ("run_import_q3", {"retry", "rerun"}),  # failed
        ("run_approval_po7", {"cancel"}),  # released, waiting for a signal
    ],
)
async def test_the_footer_offers_only_the_actions_the_runs_status_allows(run_id: str, offered: set[str]) -> None:
    async with dashboard() as (app, pilot, runtime):
        await open_run(pilot, run_id)
        keys = {"c": "cancel", "t": "retry", "n": "rerun"}
        enabled = {keys[key] for key, active in app.screen.active_bindings.items() if key in keys and active.enabled}
        assert enabled == offered
        for key in sorted(set(keys) - {key for key, kind in keys.items() if kind in offered}):
            await pilot.press(key)  # a disabled action asks nothing and does nothing
            await settle(pilot)
            assert isinstance(app.screen, RunDetailScreen) and app.screen.run_id == run_id
        assert not app._notifications
        assert len((await runtime.runs.list()).data) == 5


async def test_leaving_the_run_while_its_action_is_in_flight_neither_cancels_it_nor_loses_its_outcome() -> None:
    async with dashboard() as (app, pilot, runtime):
        client = app.client
        retry, may_finish = client.retry, asyncio.Event()

        async def slow_retry(run_id: str) -> Any:
            await may_finish.wait()  # storage is slow to answer
            return await retry(run_id)

        client.retry = slow_retry
        await open_run(pilot, "run_import_q3")
        await pilot.press("t", "y")
        await pilot.pause()
        await pilot.press("escape")  # back to the runs while the retry is in flight
        await pilot.pause()
        may_finish.set()
        await settle(pilot)
        assert isinstance(app.screen, RunsScreen)  # not taken to the new run: the operator left
        (notification,) = app._notifications
        assert notification.title == "retry" and notification.message.startswith("Created run_")
        created = [run for run in (await runtime.runs.list()).data if run.id != "run_import_q3"]
        assert any(run.source is not None and run.source.source_run_id == "run_import_q3" for run in created)


async def test_a_storage_failure_is_shown_and_the_last_rows_stay() -> None:
    async with dashboard() as (app, pilot, _):

        async def unavailable(name: str, params: dict[str, Any]) -> str:
            raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "The database is restarting.", retryable=True)

        app.client._call = unavailable
        await pilot.press("r")
        await settle(pilot)
        # The rows on screen stay, and the line says when they were read.
        assert status_line(app) == "storage_unavailable: The database is restarting." + REFRESHED
        assert len(run_ids(app)) == 5


# ---------------------------------------------------------------------------------------------
# Slow and stopped storage


class HeldReads:
    """A client over ``runtime`` whose operations named in ``held`` wait until the test lets them through,
    one ``asyncio.Event`` each (in ``pending``); ``calls`` lists every operation asked for and ``cancelled``
    counts the held ones given up before they were let through."""

    def __init__(self, runtime: Any, *held: str) -> None:
        local = DashboardClient.local(runtime)
        self.held = set(held)
        self.calls: list[str] = []
        self.pending: list[asyncio.Event] = []
        self.cancelled = 0

        async def call(name: str, params: dict[str, Any]) -> str:
            self.calls.append(name)
            if name in self.held:
                gate = asyncio.Event()
                self.pending.append(gate)
                try:
                    await gate.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            return await local._call(name, params)

        self.client = DashboardClient(call, lane=local.lane, environment=local.environment, where=local.where)


async def until(check: Any, what: str) -> None:
    """Let the app run until ``check()`` holds (a few seconds at most)."""
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_a_run_read_slower_than_the_refresh_interval_is_shown_once_read() -> None:
    """The periodic refresh lets a slow read finish (it used to cancel it at every tick, so a long history
    was never shown), says meanwhile that it is waiting, and reads the history again only when it grew."""
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        reads = HeldReads(runtime, "runs attempts")
        app = RunlaneDashboard(reads.client, refresh_interval=0.02, now=runtime.clock.now)
        async with app.run_test(size=SIZE):
            await app.push_screen(RunDetailScreen("run_approval_po7"))
            await until(lambda: "waiting" in status_line(app) or reads.cancelled, "a tick during the read")
            assert status_line(app) == "refreshing… waiting for storage since 08:00:04 UTC"
            assert reads.cancelled == 0 and len(reads.pending) == 1

            reads.pending[0].set()  # the read finishes, many refresh intervals after it started
            await until(lambda: rows(app, "attempts"), "the attempts on screen")
            assert [row[2] for row in rows(app, "events")][-1] == "run.released"
            assert status_line(app) == "1 attempts, 5 events" + REFRESHED

            # Unchanged, the run alone is read again; its attempts (the whole history) are not.
            runs_read = reads.calls.count("runs get")
            await until(lambda: reads.calls.count("runs get") >= runs_read + 5, "five more refreshes")
            assert reads.calls.count("runs attempts") == 1

            events = app.screen.query_one("#events")
            shown = dict(events.rows)
            reads.held.clear()
            runtime.clock.advance(timedelta(seconds=10))
            await runtime.runs.cancel("run_approval_po7", reason="duplicate")
            await until(lambda: app.screen.detail.run.status is RunStatus.CANCELLED, "the cancelled run")
            assert reads.calls.count("runs attempts") == 2
            assert status_line(app) == "1 attempts, 6 events  ·  refreshed 08:00:14 UTC"
            assert [row[2] for row in rows(app, "events")][-2:] == ["run.released", "run.cancelled"]
            assert all(events.rows[key] is row for key, row in shown.items())  # the rows shown stay as they are


async def test_the_runs_screen_says_how_long_it_has_waited_for_storage_that_stopped_answering() -> None:
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        reads = HeldReads(runtime)
        app = RunlaneDashboard(reads.client, refresh_interval=0.02, now=runtime.clock.now)
        async with app.run_test(size=SIZE) as pilot:
            await until(lambda: len(run_ids(app)) == 5, "the runs")
            reads.held.add("queues")  # storage stops answering
            await until(lambda: "waiting" in status_line(app) or reads.cancelled, "a tick during the read")
            assert status_line(app) == (
                "the newest 5 runs" + REFRESHED + "  ·  refreshing… waiting for storage since 08:00:04 UTC"
            )
            assert len(run_ids(app)) == 5 and reads.cancelled == 0 and len(reads.pending) == 1

            runtime.clock.advance(timedelta(seconds=10))
            await runtime.trigger(send, {"to": "cy"}, run_id="run_email_cy")
            await pilot.press("r")  # asked for, a refresh gives up the read in flight and starts again
            await until(lambda: len(reads.pending) == 2, "a second read")
            assert reads.cancelled == 1
            reads.held.clear()
            reads.pending[1].set()
            await until(lambda: "run_email_cy" in run_ids(app), "the new run")
            await until(lambda: "refreshed 08:00:14" in status_line(app), "the queue overview read after the page")
            assert status_line(app) == "the newest 6 runs  ·  refreshed 08:00:14 UTC"


# ---------------------------------------------------------------------------------------------
# Snapshots of the main screens


def snapshot(snap_compare: Any, *, run_id: str | None = None, press: tuple[str, ...] = ()) -> bool:
    """Seed inside the app's event loop (the runtime lives on it), open ``run_id`` if given, press ``press``."""
    runtime = make_runtime()
    app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0, now=runtime.clock.now)

    async def before(pilot: Any) -> None:
        await seed(runtime)
        pilot.app.screen.reload()
        await settle(pilot)
        if run_id is not None:
            await open_run(pilot, run_id)

    try:
        return bool(snap_compare(app, press=press, terminal_size=SIZE, run_before=before))
    finally:
        asyncio.run(runtime.close())


def test_snapshot_of_the_runs_screen(snap_compare: Any) -> None:
    assert snapshot(snap_compare)


def test_snapshot_of_a_failed_run(snap_compare: Any) -> None:
    assert snapshot(snap_compare, run_id="run_import_q3")


def test_snapshot_of_the_cancel_question(snap_compare: Any) -> None:
    assert snapshot(snap_compare, run_id="run_approval_po7", press=("c",))


# ---------------------------------------------------------------------------------------------
# Through a live `runlane dev` session, and the command itself

BRIDGE_TASKS = """
from runlane import queue, task

default = queue("default", default=True)
parked = queue("parked")


@task("ping")
def ping(payload: dict) -> dict:
    return {"pong": True}


@task("later", queue=parked)
def later(payload: dict) -> None:
    return None
"""


@pytest.fixture
def dev_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from cli_support import Project, make_project

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # this process computes the same session paths
    return Project(make_project(tmp_path / "proj", BRIDGE_TASKS), tmpdir)


async def test_on_a_process_local_lane_the_dashboard_reads_the_runlane_dev_process(dev_project: Any) -> None:
    from cli_support import running_dev

    from runlane.cli.bridge import read_session

    with running_dev(dev_project, "--queue", "default", "--tick-interval", "1s"):
        executed = dev_project.json("trigger", "ping", "{}")["run"]["id"]
        parked = dev_project.json("trigger", "later", "{}")["run"]["id"]  # nobody polls its queue
        session = read_session(dev_project.config)
        client = DashboardClient.bridged(session, lane="local", environment="default")
        assert client.where == f"runlane dev (pid {session.pid})"

        app = RunlaneDashboard(client, refresh_interval=0)
        async with app.run_test(size=SIZE) as pilot:
            for _ in range(100):  # the dev worker executes the ping run shortly
                await settle(pilot)
                if {row[0]: row[1] for row in rows(app, "runs")}.get(executed) == "succeeded":
                    break
                app.screen.reload()
            assert {row[0]: row[1] for row in rows(app, "runs")} == {executed: "succeeded", parked: "queued"}
            queues = {row[0]: row[1:] for row in rows(app, "queues")}
            assert queues["parked"][2] == "1"  # queued

            await open_run(pilot, parked)
            await pilot.press("c", "y")
            await settle(pilot)
        assert dev_project.json("runs", "get", parked)["run"]["status"] == "cancelled"


async def test_the_dashboard_follows_runlane_dev_to_the_process_a_restart_started(dev_project: Any) -> None:
    """``runlane dev --reload`` starts a new process (a new port and token) at every change: the open
    dashboard follows the session it records instead of saying dev is gone."""
    from cli_support import running_dev

    from runlane.cli.bridge import read_session

    with running_dev(dev_project, "--queue", "default"):
        first = read_session(dev_project.config)
        client = DashboardClient.bridged(
            first, lane="local", environment="default", find_session=lambda: read_session(dev_project.config)
        )
        assert (await client.runs()).runs == []
    with running_dev(dev_project, "--queue", "default"):
        second = read_session(dev_project.config)
        assert second is not None and second.pid != first.pid
        parked = dev_project.json("trigger", "later", "{}")["run"]["id"]
        assert [run.id for run in (await client.runs()).runs] == [parked]
        assert client.where == f"runlane dev (pid {second.pid})"
    with pytest.raises(RunlaneError) as raised:  # no runlane dev at all now
        await client.runs()
    assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE
    assert "start runlane dev again and the dashboard reconnects" in raised.value.message


def test_through_runlane_dev_the_dashboard_names_the_environment_and_lane_its_runtime_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``runtime = "module:attribute"`` only the runtime names its environment and lane: the title
    said ``default · lane runtime``, another environment than the one whose runs it showed."""
    from typer.testing import CliRunner

    import runlane.cli.tui as tui_command
    from cli_support import Project, running_dev, write
    from runlane.cli.main import build_app

    root, tmpdir = tmp_path / "proj", tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # this process computes the same session paths
    write(root / "app" / "__init__.py", "")
    write(
        root / "app" / "runtime.py",
        BRIDGE_TASKS + "\n\nfrom runlane import create_runlane\nfrom runlane_local import local_lane\n\n"
        'runlane = create_runlane(lane=local_lane(name="memory"), queues=[default, parked], tasks=[ping, later], '
        'environment="prod")\n',
    )
    write(root / "runlane.toml", '[runlane]\nruntime = "app.runtime:runlane"\n')
    opened: list[Any] = []

    async def open_dashboard(app: Any, ctx: Any) -> None:  # in place of running it in a terminal
        opened.append(app)

    monkeypatch.setattr(tui_command, "_run", open_dashboard)
    monkeypatch.chdir(root)
    with running_dev(Project(root, tmpdir), "--queue", "default") as dev:
        result = CliRunner().invoke(build_app(), ["tui"])
        assert result.exit_code == 0, result.output
    (app,) = opened
    assert (app.client.environment, app.client.lane) == ("prod", "memory")
    assert app.client.where == f"runlane dev (pid {dev.pid})"


def test_runlane_tui_refuses_a_process_local_lane_without_runlane_dev(dev_project: Any) -> None:
    result = dev_project.cli("tui")
    assert result.returncode == 1
    assert result.stderr.startswith("error[configuration_invalid]: ")
    assert "start `runlane dev` for this config" in result.stderr
    assert "Traceback" not in result.stderr


def test_runlane_tui_without_a_terminal_refuses_instead_of_drawing_into_a_pipe(tmp_path: Path) -> None:
    from cli_support import RUNLANE, cli, cli_env, make_project

    root = make_project(tmp_path / "proj", lane="sqlite")
    result = cli(root, "tui", timeout=30)  # stdin, stdout and stderr are pipes
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error[configuration_invalid]: The dashboard needs a terminal")
    closed = subprocess.run(  # started with stdin closed (runlane tui <&-): the same refusal, no traceback
        ["bash", "-c", 'exec "$0" tui <&-', RUNLANE], cwd=root, capture_output=True, text=True, timeout=30,
        env=cli_env(),
    )  # fmt: skip
    assert closed.returncode == 1, closed.stderr
    assert closed.stderr.startswith("error[configuration_invalid]: The dashboard needs a terminal")


OBSERVED_TASKS = """
from runlane import create_runlane, queue, task
from runlane_local import sqlite_lane

default = queue("default", default=True)


@task("emails.send")
def send(payload: dict) -> None:
    return None


def broken_observer(observation) -> None:
    raise ValueError("the metrics backend is down")


runlane = create_runlane(lane=sqlite_lane("runlane.db"), queues=[default], tasks=[send], observers=[broken_observer])
"""


class Terminal:
    """``runlane ARGS`` on a pseudo-terminal of 120 x 30, read as it draws (escape sequences removed in ``text``)."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> None:
        import fcntl
        import pty
        import struct
        import termios

        from cli_support import RUNLANE, cli_env

        assert RUNLANE is not None
        self.raw = b""
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: runlane itself
            try:
                os.chdir(cwd)
                os.execve(RUNLANE, [RUNLANE, *args], {**(env or cli_env()), "TERM": "xterm-256color"})
            finally:
                os._exit(127)  # never back into the tests
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))

    @property
    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?<>=]*[A-Za-z~]", " ", self.raw.decode("utf-8", "replace"))

    def until(self, shown: str, timeout: float = 30) -> None:
        import select

        deadline = time.monotonic() + timeout
        while shown not in self.text:
            left = deadline - time.monotonic()
            assert left > 0, f"never shown: {shown!r}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.1))
            if ready:
                try:
                    self.raw += os.read(self.fd, 65536)
                except OSError:  # the program exited
                    raise AssertionError(f"runlane exited before showing {shown!r}") from None

    def press(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_what_the_runtime_logs_under_the_dashboard_is_a_notification_not_lines_across_its_screen(
    tmp_path: Path,
) -> None:
    """An observer that raised on a cancel made from the dashboard: its warning and traceback were printed on
    the terminal the dashboard draws on, over its screen. They are a notification now."""
    from cli_support import cli, write

    root = tmp_path / "proj"
    write(root / "app" / "__init__.py", "")
    write(root / "app" / "tasks.py", OBSERVED_TASKS)
    write(root / "runlane.toml", '[runlane]\nruntime = "app.tasks:runlane"\n')
    assert cli(root, "trigger", "emails.send", "{}").returncode == 0
    terminal = Terminal(root, "tui", "--refresh", "off")
    try:
        terminal.until("the newest 1 run")
        terminal.press(b"\r")
        terminal.until("event sequence")
        terminal.press(b"c")
        terminal.until("Keep (n)")
        terminal.press(b"y")
        terminal.until("Cancel recorded")
        terminal.until("warning (runlane.observers)")
        terminal.until("broken_observer")
        assert "Traceback" not in terminal.text and "the metrics backend is down" not in terminal.text
        terminal.press(b"q")
    finally:
        terminal.close()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_over_runlane_dev_the_dashboard_names_the_lane_by_its_name(dev_project: Any) -> None:
    """docs/lanes.md: a lane's ``name`` is the label the dashboard shows. Over the bridge it showed the lane's
    ``use`` instead, unlike the runlane dev process it reads and the dashboard on a shared lane."""
    from cli_support import running_dev

    config = dev_project.config
    config.write_text(config.read_text().replace('use = "local"', 'use = "local"\nname = "scratch"'))
    with running_dev(dev_project, "--queue", "default"):
        terminal = Terminal(dev_project.root, "tui", "--refresh", "off", env=dev_project.env())
        try:
            terminal.until("the newest 0 runs")
            terminal.until("lane scratch · via runlane dev (pid")
            terminal.press(b"q")
        finally:
            terminal.close()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_runlane_tui_opened_while_postgres_is_down_waits_for_it_and_then_shows_the_runs(tmp_path: Path) -> None:
    """The dashboard is what an operator opens during an outage: it said storage_unavailable and ended. It
    waits for the database now, as the long-running commands do, and opens once it answers."""
    from cli_support import make_project, write
    from postgres_support import restartable_postgres_server

    server, schema = restartable_postgres_server("tui_wait")
    root = make_project(tmp_path / "proj", BRIDGE_TASKS, lane="sqlite")
    write(root / "runlane.toml", '[runlane]\ntasks = ["app.tasks"]\n\n[lane]\nuse = "postgres-polling"\n'
                                 f'connection_string = "{server.url}?schema={schema}"\n')  # fmt: skip
    server.stop_server(mode="fast")
    terminal = Terminal(root, "tui", "--refresh", "off")
    try:
        terminal.until("waiting for storage")
        server.start_server()
        terminal.until("the newest 0 runs", timeout=60)
        terminal.press(b"q")
    finally:
        terminal.close()
        if not server.running:
            server.start_server()


def test_runlane_tui_refuses_a_refresh_interval_it_cannot_keep(dev_project: Any) -> None:
    result = dev_project.cli("tui", "--refresh", "10ms")
    assert result.returncode == 2
    assert "Invalid value for '--refresh': must be at least 250ms (or off, to reload only on r), got '10ms'." in (
        result.stderr
    )
    for off in ("off", "0"):  # no live refresh: accepted (then refused here for want of a dev process)
        quiet = dev_project.cli("tui", "--refresh", off)
        assert quiet.returncode == 1 and "--refresh" not in quiet.stderr, quiet.stderr


def test_runlane_queues_counts_the_active_runs_of_each_queue(tmp_path: Path) -> None:
    from cli_support import cli, make_project

    root = make_project(tmp_path / "proj", BRIDGE_TASKS, lane="sqlite")
    for task_id in ("ping", "ping", "later"):
        assert cli(root, "trigger", task_id, "{}").returncode == 0
    result = cli(root, "--json", "queues")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    counts = {queue["name"]: queue["counts"] for queue in document["queues"]}
    assert counts["default"]["queued"] == 2 and counts["parked"]["queued"] == 1
    assert [queue["default"] for queue in document["queues"]] == [True, False]

    limited = json.loads(cli(root, "--json", "queues", "--limit", "1").stdout)
    assert limited["queues"][0]["counts"]["queued"] == 1 and limited["queues"][0]["more"] is True
    text = cli(root, "queues").stdout
    assert "default (default)" in text and "2+" not in text and "queued" in text


RENAMED_QUEUE_TASKS = """
from runlane import queue, task

default = queue("default", default=True)
reports = queue("{name}", concurrency_limit=1)


@task("reports.build", queue=reports)
def build(payload: dict) -> None:
    return None
"""


def test_runlane_queues_lists_a_queue_no_longer_registered_that_still_holds_runs(tmp_path: Path) -> None:
    """A run triggered before its queue was renamed is claimed by no worker: the overview names its queue
    as not registered instead of leaving the run out."""
    from cli_support import cli, make_project, write

    root = make_project(tmp_path / "proj", RENAMED_QUEUE_TASKS.format(name="reports"), lane="sqlite")
    assert cli(root, "trigger", "reports.build", "{}").returncode == 0
    write(root / "app" / "tasks.py", RENAMED_QUEUE_TASKS.format(name="reporting"))
    assert cli(root, "trigger", "reports.build", "{}").returncode == 0
    drained = cli(root, "work", "--drain")
    assert drained.returncode == 0, drained.stderr

    result = cli(root, "--json", "queues")
    assert result.returncode == 0, result.stderr
    queues = json.loads(result.stdout)["queues"]
    assert [(row["name"], row["registered"]) for row in queues] == [
        ("default", True), ("reporting", True), ("reports", False)
    ]  # fmt: skip
    assert queues[1]["counts"]["queued"] == 0  # the run of the renamed queue was executed
    assert queues[2] == {
        "name": "reports",
        "registered": False,
        "default": False,
        "concurrency_limit": None,
        "counts": {
            "scheduled": 0, "queued": 1, "running": 0, "retrying": 0, "released": 0, "cancellation_requested": 0
        },
        "more": False,
        "capped": [],
    }  # fmt: skip
    (row,) = [line.split() for line in cli(root, "queues").stdout.splitlines() if line.startswith("reports ")]
    assert row == ["reports", "(not", "registered)", "?", "0", "1", "0", "0", "0", "0"]

    # A status with more runs than the limit is a lower bound for a queue found only by the walk over all
    # queues (oldest first: the run left behind is found before the newer backlog).
    for _ in range(2):
        assert cli(root, "trigger", "reports.build", "{}").returncode == 0
    queues = json.loads(cli(root, "--json", "queues", "--limit", "2").stdout)["queues"]
    assert [(row["name"], row["counts"]["queued"], row["capped"]) for row in queues] == [
        ("default", 0, []), ("reporting", 2, []), ("reports", 1, ["queued"])
    ]  # fmt: skip


APPROVAL_TASKS = """
from runlane import queue, task

default = queue("default", default=True)


@task("approve")
def approve(payload: dict, ctx) -> object:
    return ctx.wait_for_signal("approved", timeout="7d")


@task("ping")
def ping(payload: dict) -> None:
    return None
"""


def test_runlane_queues_counts_each_status_on_its_own_during_a_backlog(tmp_path: Path) -> None:
    """Newer queued runs beyond the limit do not hide the older runs waiting for a signal: each status is
    counted up to the limit, and only a status with more runs than that shows a +."""
    from cli_support import cli, make_project

    root = make_project(tmp_path / "proj", APPROVAL_TASKS, lane="sqlite")
    for _ in range(2):
        assert cli(root, "trigger", "approve", "{}").returncode == 0
    drained = cli(root, "work", "--drain")
    assert drained.returncode == 0, drained.stderr
    for _ in range(3):  # then a backlog arrives
        assert cli(root, "trigger", "ping", "{}").returncode == 0

    (default,) = json.loads(cli(root, "--json", "queues", "--limit", "2").stdout)["queues"]
    assert default["counts"] == {
        "scheduled": 0, "queued": 2, "running": 0, "retrying": 0, "released": 2, "cancellation_requested": 0
    }  # fmt: skip
    assert default["more"] is True and default["capped"] == ["queued"]  # exactly 2 released runs: not capped

    (default,) = json.loads(cli(root, "--json", "queues").stdout)["queues"]
    assert default["counts"]["queued"] == 3 and default["counts"]["released"] == 2
    assert default["more"] is False and default["capped"] == []

    text = cli(root, "queues", "--limit", "2").stdout
    (row,) = [line.split() for line in text.splitlines() if line.lstrip().startswith("default")]
    assert row[-6:] == ["0", "2+", "0", "0", "2", "0"]


async def test_the_queue_overview_marks_only_the_counts_that_reached_the_limit() -> None:
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        for number in range(3):
            await runtime.trigger(send, {"to": number})  # newer than the run waiting for a signal
        local = DashboardClient.local(runtime)

        async def counting_two(name: str, params: dict[str, Any]) -> str:
            return await local._call(name, {**params, "limit": 2} if name == "queues" else params)

        client = DashboardClient(counting_two, lane=local.lane, environment=local.environment, where=local.where)
        app = RunlaneDashboard(client, refresh_interval=0)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            queues = {row[0]: row[1:] for row in rows(app, "queues")}
            assert queues["default (default)"] == ["-", "0", "2+", "0", "0", "1", "0"]
            assert queues["reports"] == ["2", "0", "1", "0", "0", "0", "0"]


async def test_the_queue_overview_shows_a_queue_this_program_does_not_register() -> None:
    lane = local_lane()
    elsewhere = queue("elsewhere")
    other = create_runlane(lane=lane, queues=[default, elsewhere], tasks=[send], clock=ControlledClock(T0))
    async with other:
        await other.trigger(send, {"to": "eve"}, queue=elsewhere, run_id="run_elsewhere")
    runtime = create_runlane(lane=lane, queues=[default, reports], tasks=[send], clock=ControlledClock(T0))
    async with runtime:
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            queues = {row[0]: row[1:] for row in rows(app, "queues")}
            assert queues["elsewhere (not registered)"] == ["?", "0", "1", "0", "0", "0", "0"]
            assert queues["reports"] == ["2", "0", "0", "0", "0", "0", "0"]
            await choose_queue(pilot, "elsewhere")
            await settle(pilot)
            assert run_ids(app) == ["run_elsewhere"]


# ---------------------------------------------------------------------------------------------
# Filters and pages changed faster than storage answers


@asynccontextmanager
async def paged_dashboard() -> AsyncIterator[tuple[Any, Any, HeldReads]]:
    """The seeded dashboard, two runs a page, on the newest page, over a client whose reads the test can hold."""
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        reads = HeldReads(runtime)
        app = RunlaneDashboard(reads.client, refresh_interval=0, page_size=2, now=runtime.clock.now)
        async with app.run_test(size=SIZE) as pilot:
            await until(lambda: run_ids(app) == ["run_report_nov", "run_approval_po7"], "the newest page")
            yield app, pilot, reads


def filter_label(app: Any) -> str:
    return str(app.screen.query_one("#status-filter").render())


def let_through(reads: HeldReads) -> None:
    reads.held.clear()
    for gate in reads.pending:
        gate.set()


async def choose_queue(pilot: Any, name: str) -> None:
    table = pilot.app.screen.query_one("#queues")
    table.focus()
    table.move_cursor(row=table.get_row_index(name))
    await pilot.press("enter")


@pytest.mark.parametrize("change", ["status", "queue"])
async def test_older_pressed_before_a_new_filters_first_page_arrives_waits_for_it(change: str) -> None:
    """``]`` right after a filter change used to send the previous filter's cursor, which storage refuses:
    the error stayed, over the old filter's rows, until ``[`` or ``esc``."""
    async with paged_dashboard() as (app, pilot, reads):
        assert app.screen.next_cursor is not None
        reads.held.add("runs list")  # storage is slow to answer from now on
        if change == "status":
            await pilot.press("s", "s")  # status: failed
        else:
            await choose_queue(pilot, "default")
        await pilot.press("right_square_bracket")
        # The old listing is gone at once: no rows, no next page to go to.
        assert app.screen.page_cursors == [None] and app.screen.next_cursor is None
        assert run_ids(app) == []
        assert status_line(app) == "reading the newest runs…" + REFRESHED
        let_through(reads)
        expected = ["run_import_q3"] if change == "status" else ["run_approval_po7", "run_import_q3"]
        await until(lambda: run_ids(app) == expected, "the new filter's first page")
        await settle(pilot)
        assert ("status: failed" if change == "status" else "queue: default") in filter_label(app)
        assert status_line(app).startswith("the newest ") and "validation_failed" not in status_line(app)
        await pilot.press("r")
        await settle(pilot)
        assert run_ids(app) == expected and "validation_failed" not in status_line(app)


async def test_brackets_pressed_before_the_page_arrives_move_one_page_at_a_time() -> None:
    """``]]`` pressed quickly used to say "page 3" over page 2's rows."""
    async with paged_dashboard() as (app, pilot, reads):
        reads.held.add("runs list")
        await pilot.press("right_square_bracket", "right_square_bracket")
        assert len(app.screen.page_cursors) == 2
        assert status_line(app) == "reading page 2…  ([ newer)" + REFRESHED
        let_through(reads)
        await until(lambda: run_ids(app) == ["run_import_q3", "run_email_bob"], "page 2")
        await settle(pilot)
        assert status_line(app) == "2 runs on page 2  (] older, [ newer)" + REFRESHED

        reads.held.add("runs list")
        await pilot.press("right_square_bracket", "left_square_bracket", "left_square_bracket")
        assert app.screen.page_cursors == [None]
        let_through(reads)
        await until(lambda: run_ids(app) == ["run_report_nov", "run_approval_po7"], "the newest page again")
        await settle(pilot)
        assert status_line(app) == "the newest 2 runs  (] older)" + REFRESHED


async def test_a_page_is_shown_without_waiting_for_the_queue_overview() -> None:
    """The queue overview counts every queue's runs, far slower than one page on a large store: a page or
    filter key used to show its rows only once the overview had been counted again too."""
    async with paged_dashboard() as (app, pilot, reads):
        reads.held.add("queues")  # counting the queues is slow from now on
        await pilot.press("right_square_bracket")
        await until(lambda: run_ids(app) == ["run_import_q3", "run_email_bob"], "page 2, before the queues")
        assert status_line(app) == "2 runs on page 2  (] older, [ newer)" + REFRESHED
        assert len(reads.pending) == 1  # the overview is still being counted
        let_through(reads)
        await settle(pilot)
        assert rows(app, "queues") and run_ids(app) == ["run_import_q3", "run_email_bob"]


async def test_a_page_read_for_a_listing_no_longer_asked_for_is_dropped() -> None:
    """A read that finishes although a filter change superseded it (a driver that does not stop on
    cancellation) is not shown under the new filter."""
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        local = DashboardClient.local(runtime)
        stubborn: list[asyncio.Event] = []

        async def call(name: str, params: dict[str, Any]) -> str:
            if name == "runs list" and params.get("status") is None and stubborn:
                gate = stubborn[0]
                while not gate.is_set():
                    with contextlib.suppress(asyncio.CancelledError):  # finishes what it started regardless
                        await gate.wait()
            return await local._call(name, params)

        client = DashboardClient(call, lane=local.lane, environment=local.environment, where=local.where)
        app = RunlaneDashboard(client, refresh_interval=0, page_size=2, now=runtime.clock.now)
        async with app.run_test(size=SIZE) as pilot:
            await until(lambda: len(run_ids(app)) == 2, "the newest page")
            stubborn.append(asyncio.Event())
            await pilot.press("r")  # a read of "all" that will not stop
            await pilot.pause()
            await pilot.press("s", "s")  # status: failed, read at once
            await until(lambda: run_ids(app) == ["run_import_q3"], "the failed runs")
            stubborn[0].set()  # the read of "all" finishes now
            await settle(pilot)
            assert "status: failed" in filter_label(app)
            assert run_ids(app) == ["run_import_q3"]
            assert status_line(app) == "the newest 1 run" + REFRESHED


async def test_a_filter_change_keeps_the_cursor_on_its_run_when_the_new_page_lists_it() -> None:
    async with dashboard() as (app, pilot, runtime):
        await pilot.press("down", "down")
        table = app.screen.query_one("#runs")
        assert table.cursor_key == "run_import_q3"
        await pilot.press("s", "s")  # status: failed
        await settle(pilot)
        assert run_ids(app) == ["run_import_q3"] and table.cursor_key == "run_import_q3"
        await pilot.press("escape")
        await settle(pilot)
        assert len(run_ids(app)) == 5 and table.cursor_key == "run_import_q3"


# ---------------------------------------------------------------------------------------------
# Small terminals and long errors


LONG_ERROR = "Could not connect to Postgres at db.internal:5432/runlane: " + "connection refused; " * 8


@pytest.mark.parametrize("width", [60, 120, 160])
async def test_a_long_error_never_pushes_the_refresh_time_off_the_status_line(width: int) -> None:
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0, now=runtime.clock.now)
        async with app.run_test(size=(width, 24)) as pilot:
            await settle(pilot)

            async def unavailable(name: str, params: dict[str, Any]) -> str:
                raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, LONG_ERROR, retryable=True)

            app.client._call = unavailable
            await pilot.press("r")
            await settle(pilot)
            line = app.screen.query_one("#status-line")
            shown = status_line(app)
            assert len(shown) <= line.content_size.width
            assert shown.endswith("…" + REFRESHED) and shown.startswith("storage_unavailable: Could not")
            assert str(line.tooltip) == f"storage_unavailable: {LONG_ERROR}"  # the whole error, on hover
            painted = ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]
            assert painted[-2].rstrip().endswith("refreshed 08:00:04 UTC")  # the row above the footer

            line.waiting(runtime.clock.now())  # storage stopped answering: both times stay in sight
            await pilot.pause()
            shown = status_line(app)
            assert len(shown) <= line.content_size.width
            assert "refreshed 08:00:04 UTC  ·  refreshing… waiting" in shown
            assert shown.startswith("storage_unavailable: Could not") == (width > 100)  # no room at 60 columns


@pytest.mark.parametrize("size", [(60, 15), (80, 24)])
async def test_on_a_small_terminal_the_runs_stay_in_sight_and_the_question_fits(size: tuple[int, int]) -> None:
    runtime = make_runtime()
    async with runtime:
        await seed(runtime)
        await runtime.trigger(send, {"to": "cy"}, queue="reports")  # more queues and runs than fit
        for number in range(20):
            await runtime.trigger(send, {"to": number})
        app = RunlaneDashboard(DashboardClient.local(runtime), refresh_interval=0, now=runtime.clock.now)
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            screen = app.screen.region
            table = app.screen.query_one("#runs")
            visible = table.scrollable_content_region.height - 1  # under the header row
            assert visible >= (4 if size == (60, 15) else 8)
            assert screen.contains_region(table.region)
            assert app.screen.query_one("#queues").region.height >= 3  # a header and two queues at least

            await open_run(pilot, "run_approval_po7")
            await pilot.press("c")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            question = app.screen.query_one("#question")
            assert "asked to stop." in str(question.render())
            for part in ("#confirm", "#question", "#yes", "#no"):
                region = app.screen.query_one(part).region
                assert region.width and screen.contains_region(region), (part, region)
            assert app.screen.query_one("#confirm").region.width <= size[0]
            await pilot.press("n")


# ---------------------------------------------------------------------------------------------
# The client on its own


def test_the_dashboard_client_works_without_the_cli_imported_first(tmp_path: Path) -> None:
    """The operations register when their ``runlane.cli`` modules are imported: the client imports them."""
    script = tmp_path / "client.py"
    script.write_text(
        "import asyncio\n"
        "from runlane_local import local_lane\n"
        "from runlane import create_runlane, queue, task\n"
        "from runlane.tui import DashboardClient\n"
        "default = queue('default', default=True)\n"
        "@task('emails.send')\n"
        "async def send(payload: dict) -> None:\n"
        "    return None\n"
        "async def main() -> None:\n"
        "    async with create_runlane(lane=local_lane(), queues=[default], tasks=[send]) as runtime:\n"
        "        run = (await runtime.trigger(send, {})).run\n"
        "        client = DashboardClient.local(runtime)\n"
        "        page = await client.runs()\n"
        "        assert [summary.id for summary in page.runs] == [run.id]\n"
        "        assert (await client.run(run.id)).run.id == run.id\n"
        "        assert (await client.cancel(run.id)).id == run.id\n"
        "        print('ok')\n"
        "asyncio.run(main())\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
