"""``RunDetailScreen``: one run's card, attempts and event timeline, with its operator actions.

``c`` cancels the run, ``t`` retries a failed run and ``n`` reruns a finished one (each a new run
with the same payload); each asks first, and the footer shows the ones the run's status rules out
as disabled. A retry or rerun opens the new run. The runtime decides what is allowed: a refused
action is shown with its error code and message. One that storage (or the ``runlane dev`` process) did
not answer is not called refused: it may have been recorded before the connection failed, so the
notification says to check the run before trying again (a second rerun would be a second new run). An
action runs on the app, not on this screen: leaving the screen while it is in flight neither cancels
it nor loses its outcome.

A refresh reads the run alone first and its attempts and events only when its event sequence or
status moved: a long history is read again only when it grew. The tables change only the rows that
changed, so a run with thousands of attempts stays responsive.
"""

from __future__ import annotations

from dataclasses import replace

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import Footer, Header, Label

from ...cli.output import attempt_details, display_value, event_detail
from ...errors import ErrorCode, RunlaneError
from ...models import RunRecord
from ...vocabulary import RunStatus
from ..client import RunDetail
from ..format import printable, printable_text, short_time, status_text
from ..messages import RunChanged
from ..widgets.keyed_table import KeyedTable
from ..widgets.run_card import RunCard
from ..widgets.status_line import StatusLine
from .confirm import ConfirmScreen
from .live import LiveScreen

__all__ = ["RunDetailScreen"]

_FINISHED = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})

# Whether each action applies to a run in a status (the runtime's own rules, checked again there).
_APPLIES = {
    "cancel": lambda status: status not in _FINISHED,
    "retry": lambda status: status is RunStatus.FAILED,
    "rerun": lambda status: status in _FINISHED,
}

_ACTIONS = {
    "cancel": ("Cancel run {run_id}? A running attempt is asked to stop.", "Cancel run"),
    "retry": ("Retry failed run {run_id}? This creates a new run with its payload.", "Retry"),
    "rerun": ("Rerun run {run_id}? This creates a new run with its payload, whatever its outcome.", "Rerun"),
}

# Errors that leave an action's outcome unknown: the request may have been recorded before the answer was lost.
_OUTCOME_UNKNOWN = frozenset({ErrorCode.STORAGE_UNAVAILABLE, ErrorCode.TRANSPORT_UNAVAILABLE})
_CHECK_FIRST = " It may have been recorded before the answer was lost: check the run (r refreshes) before trying again."


class RunDetailScreen(LiveScreen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("c", "act('cancel')", "Cancel"),
        Binding("t", "act('retry')", "Retry"),
        Binding("n", "act('rerun')", "Rerun"),
    ]

    def __init__(self, run_id: str) -> None:
        super().__init__()
        self.run_id = run_id
        self.detail: RunDetail | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="detail"):
            yield RunCard(id="card")
            yield Label("Attempts", classes="section")
            yield KeyedTable(id="attempts", cursor_type="none")
            yield Label("Events", classes="section")
            yield KeyedTable(id="events", cursor_type="none")
        yield StatusLine()
        yield Footer()

    def on_mount(self) -> None:
        attempts = self.query_one("#attempts", KeyedTable)
        # Times are UTC, as everywhere in the dashboard: the labels say so.
        for column in ("attempt", "status", "started", "completed", "detail"):
            attempts.add_column(f"{column} (UTC)" if column in ("started", "completed") else column, key=column)
        events = self.query_one("#events", KeyedTable)
        for column in ("seq", "time", "event", "detail"):
            events.add_column("time (UTC)" if column == "time" else column, key=column)
        self.start_refreshing()

    def on_screen_resume(self) -> None:
        self.refresh_if_idle()  # back from a question or the screen of a run opened from this one

    @work(exclusive=True, group="detail")
    async def read(self) -> None:
        client = self.dashboard.client
        known = self.detail
        detail: RunDetail | RunlaneError
        try:
            if known is not None:
                run = await client.run_record(self.run_id)
                if not _moved(known.run, run):
                    detail = replace(known, run=run)
                    self._show(detail, history=False)
                    return
            detail = await client.run(self.run_id)
        except RunlaneError as error:
            detail = error
        self._show(detail, history=True)

    def _show(self, detail: RunDetail | RunlaneError, *, history: bool) -> None:
        """``detail`` on screen (with its attempts and events if ``history``), or the error reading it."""
        try:
            if isinstance(detail, RunlaneError):
                self.status_line.failed(detail)
                return
            previous = self.detail
            self.detail = detail
            if previous is None or previous.run.status is not detail.run.status:
                self.refresh_bindings()  # the actions the footer offers follow the status
            self.query_one("#card", RunCard).show(detail.run)
            if history:
                self._show_history(detail)
            self.status_line.refreshed(self.dashboard.now())
        except NoMatches:
            return  # the screen was closed while its run was read

    def _show_history(self, detail: RunDetail) -> None:
        self.query_one("#attempts", KeyedTable).show_rows(
            (
                str(attempt.attempt),
                (
                    str(attempt.attempt),
                    status_text(attempt.status),
                    short_time(attempt.started_at),
                    short_time(attempt.completed_at),
                    printable_text(text),
                ),
            )
            for attempt, text in zip(detail.attempts, attempt_details(detail.run, detail.attempts))
        )
        self.query_one("#events", KeyedTable).show_rows(
            (
                str(record.sequence),
                (
                    str(record.sequence),
                    short_time(record.event.occurred_at),
                    printable_text(display_value(record.event.type), "cyan"),
                    printable_text(event_detail(record.event)),
                ),
            )
            for record in detail.events
        )
        earlier = detail.earlier_events
        total = len(detail.events) + earlier
        more = (
            f" (the newest {len(detail.events)}; the {earlier} before: runlane runs get {detail.run.id} --events)"
            if earlier
            else ""
        )
        shown = f"{len(detail.attempts)} attempts, {total} events{more}"
        self.status_line.show_message(printable_text(shown))

    # -- actions --------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """An action the run's status rules out is shown disabled and does nothing (until the run is
        read, every action is offered: the runtime decides)."""
        if action != "act" or self.detail is None or not parameters:
            return True
        applies = _APPLIES.get(str(parameters[0]))
        return None if applies is not None and not applies(self.detail.run.status) else True

    def action_act(self, kind: str) -> None:
        question, label = _ACTIONS[kind]

        def answered(confirmed: bool | None) -> None:
            if confirmed:
                self.app.run_worker(self.perform(kind), group="actions")

        self.app.push_screen(ConfirmScreen(question.format(run_id=self.run_id), action=label), answered)

    async def perform(self, kind: str) -> None:
        """Run ``kind`` on the run and report its outcome through the app, whatever screen is showing by then."""
        app = self.app
        client = self.dashboard.client
        try:
            run = await getattr(client, kind)(self.run_id)
        except RunlaneError as error:
            unknown = error.code in _OUTCOME_UNKNOWN
            app.notify(
                printable(error.message + (_CHECK_FIRST if unknown else "")),
                title=f"{kind} {'not confirmed' if unknown else 'refused'}: {error.code.value}",
                severity="error",
                timeout=8,
                markup=False,
            )
            return
        if kind == "cancel":
            app.notify(
                printable(f"Cancel recorded for {run.id}: it is {display_value(run.status)}."),
                title="cancel",
                markup=False,
            )
            if self.is_current:
                self.post_message(RunChanged(self.run_id))
                self.reload()
            return
        app.notify(printable(f"Created {run.id} from {self.run_id}."), title=kind, markup=False)
        if self.is_current:  # the operator is still looking at this run: open the new one
            self.post_message(RunChanged(self.run_id, created_run_id=run.id))
            app.switch_screen(RunDetailScreen(run.id))


def _moved(shown: RunRecord, current: RunRecord) -> bool:
    """Whether ``current`` has history ``shown`` does not: every change to a run appends an event."""
    return current.event_sequence != shown.event_sequence or current.status != shown.status
