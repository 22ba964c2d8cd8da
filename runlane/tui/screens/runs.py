"""``RunsScreen``: the queue overview above the newest runs, refreshed live.

``/`` filters the rows by text (run id, task, queue); ``s`` cycles the status filter (asked of storage);
Enter on a queue filters the runs by that queue (Enter again clears it); Enter on a run opens it.
``]`` and ``[`` page through older and newer runs; changing a filter goes back to the newest page.
The status line says when the rows were last refreshed.

A filter or page change forgets what was listed before at once: the rows, the page's next cursor (``]``
waits for the new page, whose cursor it needs) and any read still on its way for the old listing, so the
filter label, the page number and the rows on screen always describe the same listing.
"""

from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer, Header, Input, Label

from ...cli.queues import ACTIVE_STATUSES
from ...errors import RunlaneError
from ...models import RunSummary
from ..client import QueueRow
from ..format import printable_text
from ..messages import RunChanged
from ..widgets.queue_table import QueueTable
from ..widgets.runs_table import RunsTable
from ..widgets.status_line import StatusLine
from .live import LiveScreen
from .run_detail import RunDetailScreen

__all__ = ["STATUS_FILTERS", "RunsScreen"]

STATUS_FILTERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all", ()),
    ("active", tuple(status.value for status in ACTIVE_STATUSES)),
    ("failed", ("failed",)),
    ("running", ("running",)),
    ("queued", ("queued",)),
    ("scheduled", ("scheduled",)),
    ("waiting", ("released",)),
    ("retrying", ("retrying",)),
    ("cancelling", ("cancellation_requested",)),
    ("succeeded", ("succeeded",)),
    ("cancelled", ("cancellation_requested", "cancelled")),
)
"""The statuses ``s`` cycles through, each asked of storage: every active one the queue overview counts has
a filter of its own (``cancelling`` is ``cancellation_requested``, as in the overview's heading)."""


class RunsScreen(LiveScreen):
    BINDINGS = [
        Binding("slash", "focus_filter", "Filter"),
        Binding("s", "next_status", "Status"),
        Binding("escape", "clear_filters", "Clear filters"),
        Binding("right_square_bracket", "older", "Older"),
        Binding("left_square_bracket", "newer", "Newer"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.status_index = 0
        self.queue_filter: str | None = None
        self.text_filter = ""
        self.queues: list[QueueRow] = []
        self.runs: list[RunSummary] = []
        self.page_cursors: list[str | None] = [None]  # the cursor of each page from the newest one
        self.next_cursor: str | None = None  # the older page's cursor, once the page on screen was read
        self.listing = 0  # counts the changes of what is listed; a read for an earlier listing is dropped
        self.pending = True  # the current listing's first page has not arrived yet
        self._cursor_run: str | None = None  # the run to keep the cursor on across a listing change

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label("Queues", classes="section")
        yield QueueTable(id="queues")
        with Horizontal(id="filters"):
            yield Label("Runs", classes="section")
            yield Input(placeholder="/ to narrow this page by run id, task or queue", id="filter")
            yield Label("", id="status-filter")
        yield RunsTable(id="runs")
        yield StatusLine()
        yield Footer()

    def on_mount(self) -> None:
        self._show_filters()
        self.query_one("#runs", RunsTable).focus()
        self.start_refreshing()

    def on_screen_resume(self) -> None:
        self.reload()

    # -- data -----------------------------------------------------------------------------------

    @work(exclusive=True, group="runs")
    async def read(self) -> None:
        client = self.dashboard.client
        # What to list is taken once, before the first await: the filters and pages can change meanwhile.
        listing = self.listing
        statuses = STATUS_FILTERS[self.status_index][1]
        queue_filter = [self.queue_filter] if self.queue_filter else []
        cursor = self.page_cursors[-1]
        # The page first, then the queue overview: counting every queue's runs takes far longer than one
        # page on a large store, and a key that pages or filters should show its rows without waiting for it.
        try:
            page = await client.runs(
                statuses=statuses, queues=queue_filter, cursor=cursor, limit=self.dashboard.page_size
            )
            if listing != self.listing:
                return  # a page of a listing no longer on screen
            self.runs, self.next_cursor = page.runs, page.next_cursor
            self.pending = False
            self._render_tables()
            table = self.query_one("#runs", RunsTable)
            if self._cursor_run is not None and self._cursor_run in table.rows:
                table.move_cursor(row=table.get_row_index(self._cursor_run))
            self._cursor_run = None
            self.queues = await client.queues()
        except RunlaneError as error:
            if listing == self.listing:
                self.status_line.failed(error)
            return
        self.query_one("#queues", QueueTable).show(self.queues, self.queue_filter)
        self.status_line.refreshed(self.dashboard.now())

    def _render_tables(self) -> None:
        self.query_one("#queues", QueueTable).show(self.queues, self.queue_filter)
        needle = self.text_filter.lower()
        shown = [
            run
            for run in self.runs
            if not needle or any(needle in field.lower() for field in (run.id, run.task_id, run.queue))
        ]
        self.query_one("#runs", RunsTable).show(shown)
        page = len(self.page_cursors)
        if self.pending:
            reading = "reading the newest runs…" if page == 1 else f"reading page {page}…  ([ newer)"
            self.status_line.show_message(Text(reading))
            return
        listed = f"{len(self.runs)} run{'' if len(self.runs) == 1 else 's'}"
        runs = f"the newest {listed}" if page == 1 else f"{listed} on page {page}"
        count = f"{len(shown)} of {runs}" if needle else runs
        keys = [key for key, shown_if in (("] older", self.next_cursor), ("[ newer", page > 1)) if shown_if]
        self.status_line.show_message(Text(count + (f"  ({', '.join(keys)})" if keys else "")))

    def _show_filters(self) -> None:
        name = STATUS_FILTERS[self.status_index][0]
        queue = f"  queue: {self.queue_filter}" if self.queue_filter else ""
        self.query_one("#status-filter", Label).update(printable_text(f"status: {name}{queue}"))

    # -- events ---------------------------------------------------------------------------------

    @on(DataTable.RowSelected, "#runs")
    def _open_run(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.app.push_screen(RunDetailScreen(event.row_key.value))

    @on(DataTable.RowSelected, "#queues")
    def _filter_queue(self, event: DataTable.RowSelected) -> None:
        chosen = event.row_key.value
        self.queue_filter = None if chosen == self.queue_filter else chosen
        self._show_filters()
        self._first_page()

    @on(Input.Changed, "#filter")
    def _filter_text(self, event: Input.Changed) -> None:
        self.text_filter = event.value.strip()
        self._render_tables()

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self.query_one("#runs", RunsTable).focus()

    def on_run_changed(self, message: RunChanged) -> None:
        self.reload()

    # -- actions --------------------------------------------------------------------------------

    def action_focus_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    def action_next_status(self) -> None:
        self.status_index = (self.status_index + 1) % len(STATUS_FILTERS)
        self._show_filters()
        self._first_page()

    def action_clear_filters(self) -> None:
        self.status_index, self.queue_filter = 0, None
        self.query_one("#filter", Input).value = ""
        self._show_filters()
        self.query_one("#runs", RunsTable).focus()
        self._first_page()

    def action_older(self) -> None:
        # No next cursor until the page on screen has arrived: ``]`` goes past the page shown, never another.
        if self.next_cursor is not None:
            self._list([*self.page_cursors, self.next_cursor])

    def action_newer(self) -> None:
        if len(self.page_cursors) > 1:
            self._list(self.page_cursors[:-1])

    def _first_page(self) -> None:
        self._list([None])

    def _list(self, page_cursors: list[str | None]) -> None:
        """List the page ``page_cursors`` ends at, under the current filters, forgetting the listing shown: its
        rows and next cursor go now, and a read of it still on its way is dropped when it arrives."""
        if not self.pending:
            self._cursor_run = self.query_one("#runs", RunsTable).cursor_key
        self.listing += 1
        self.page_cursors, self.next_cursor, self.runs, self.pending = page_cursors, None, [], True
        self._render_tables()
        self.reload()
