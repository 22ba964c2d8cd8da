"""``RunlaneDashboard``: the Textual app behind ``runlane tui``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

from textual.app import App
from textual.binding import Binding
from textual.notifications import SeverityLevel

from .client import RUNS_PAGE, DashboardClient
from .format import printable
from .messages import RunChanged
from .screens.runs import RunsScreen

__all__ = ["RunlaneDashboard"]


class RunlaneDashboard(App[None]):
    """Runs, queues and run details of one configured runtime, refreshed every ``refresh_interval`` seconds
    (0 turns the live refresh off; ``r`` refreshes on demand); the runs table pages ``page_size`` runs.
    ``now`` is the wall clock the status lines tell the time of the last refresh by."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "Runlane"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("r", "refresh", "Refresh"),
    ]
    # Classes dashboard.tcss fits the screens to a small terminal with.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (48, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (20, "-tall")]

    def __init__(
        self,
        client: DashboardClient,
        *,
        refresh_interval: float = 2.0,
        page_size: int = RUNS_PAGE,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__()
        self.client = client
        self.refresh_interval = refresh_interval
        self.page_size = page_size
        self.now = now

    def on_mount(self) -> None:
        self.show_source()
        self.push_screen(RunsScreen())

    def show_source(self) -> None:
        """The title's environment, lane and where the data comes from (a new runlane dev process after a
        restart)."""
        self.sub_title = printable(f"{self.client.environment} · lane {self.client.lane} · via {self.client.where}")

    def show_log(self, record: logging.LogRecord) -> None:
        """A log record of the runtime the dashboard reads (an observer that raised, a wakeup not published),
        as a notification; from any thread."""
        severity: SeverityLevel = "information"
        if record.levelno >= logging.WARNING:
            severity = "error" if record.levelno >= logging.ERROR else "warning"
        self.notify(
            printable(record.getMessage()),
            title=f"{record.levelname.lower()} ({record.name})",
            severity=severity,
            timeout=10,
            markup=False,
        )

    def action_refresh(self) -> None:
        reload = getattr(self.screen, "reload", None)
        if callable(reload):
            reload()

    def on_run_changed(self, message: RunChanged) -> None:
        # A screen underneath (the runs table) shows the change when it is resumed; nothing to do here.
        message.stop()
