"""``RunDetailScreen``: one run's card, attempts and event timeline, with its operator actions.

``c`` cancels the run, ``t`` retries a failed run and ``n`` reruns a finished one (each a new run
with the same payload); each asks first. A retry or rerun opens the new run. The runtime
decides what is allowed: a refused action is shown with its error code and message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label, Static

from ...cli.output import attempt_detail, display_value, event_detail
from ...errors import RunlaneError
from ..client import RunDetail
from ..format import error_text, printable, printable_text, short_time, status_text
from ..messages import RunChanged
from ..widgets.run_card import RunCard
from .confirm import ConfirmScreen

if TYPE_CHECKING:
    from ..app import RunlaneDashboard

__all__ = ["RunDetailScreen"]

_ACTIONS = {
    "cancel": ("Cancel run {run_id}? A running attempt is asked to stop.", "Cancel run"),
    "retry": ("Retry failed run {run_id}? This creates a new run with its payload.", "Retry"),
    "rerun": ("Rerun run {run_id}? This creates a new run with its payload, whatever its outcome.", "Rerun"),
}


class RunDetailScreen(Screen[None]):
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

    @property
    def dashboard(self) -> RunlaneDashboard:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="detail"):
            yield RunCard(id="card")
            yield Label("Attempts", classes="section")
            yield DataTable(id="attempts", cursor_type="none", zebra_stripes=True)
            yield Label("Events", classes="section")
            yield DataTable(id="events", cursor_type="none", zebra_stripes=True)
        yield Static("", id="status-line")
        yield Footer()

    def on_mount(self) -> None:
        attempts = self.query_one("#attempts", DataTable)
        for column in ("attempt", "status", "started", "completed", "detail"):
            attempts.add_column(column, key=column)
        events = self.query_one("#events", DataTable)
        for column in ("seq", "time", "event", "detail"):
            events.add_column(column, key=column)
        self.reload()
        if self.dashboard.refresh_interval > 0:
            self.set_interval(self.dashboard.refresh_interval, self.reload)

    @work(exclusive=True, group="detail")
    async def reload(self) -> None:
        detail: RunDetail | RunlaneError
        try:
            detail = await self.dashboard.client.run(self.run_id)
        except RunlaneError as error:
            detail = error
        try:
            if isinstance(detail, RunlaneError):
                self.query_one("#status-line", Static).update(error_text(detail))
                return
            self.detail = detail
            self._show(detail)
        except NoMatches:
            return  # the screen was closed while its run was read

    def _show(self, detail: RunDetail) -> None:
        self.query_one("#card", RunCard).show(detail.run)
        attempts = self.query_one("#attempts", DataTable)
        attempts.clear()
        for attempt in detail.attempts:
            attempts.add_row(
                str(attempt.attempt),
                status_text(attempt.status),
                short_time(attempt.started_at),
                short_time(attempt.completed_at),
                printable_text(attempt_detail(attempt)),
            )
        events = self.query_one("#events", DataTable)
        events.clear()
        for record in detail.events:
            event = record.event
            events.add_row(
                str(record.sequence),
                short_time(event.occurred_at),
                printable_text(display_value(event.type), "cyan"),
                printable_text(event_detail(event)),
            )
        earlier = detail.earlier_events
        total = len(detail.events) + earlier
        more = (
            f" (the newest {len(detail.events)}; the {earlier} before: runlane runs get {detail.run.id} --events)"
            if earlier
            else ""
        )
        shown = f"{len(detail.attempts)} attempts, {total} events{more}"
        self.query_one("#status-line", Static).update(printable_text(shown))

    # -- actions --------------------------------------------------------------------------------

    def action_act(self, kind: str) -> None:
        question, label = _ACTIONS[kind]

        def answered(confirmed: bool | None) -> None:
            if confirmed:
                self.perform(kind)

        self.app.push_screen(ConfirmScreen(question.format(run_id=self.run_id), action=label), answered)

    @work(group="actions")
    async def perform(self, kind: str) -> None:
        client = self.dashboard.client
        try:
            run = await getattr(client, kind)(self.run_id)
        except RunlaneError as error:
            self.notify(
                printable(error.message),
                title=f"{kind} refused: {error.code.value}",
                severity="error",
                timeout=8,
                markup=False,
            )
            return
        if kind == "cancel":
            self.notify(
                printable(f"Cancel recorded for {run.id}: it is {display_value(run.status)}."),
                title="cancel",
                markup=False,
            )
            self.post_message(RunChanged(self.run_id))
            self.reload()
            return
        self.notify(printable(f"Created {run.id} from {self.run_id}."), title=kind, markup=False)
        self.post_message(RunChanged(self.run_id, created_run_id=run.id))
        self.app.switch_screen(RunDetailScreen(run.id))
