"""``LiveScreen``: a screen whose data is read in a worker, every refresh interval and on demand."""

from __future__ import annotations

import time
from datetime import datetime
from typing import TYPE_CHECKING

from textual.screen import Screen
from textual.worker import Worker

from ..widgets.status_line import StatusLine

if TYPE_CHECKING:
    from ..app import RunlaneDashboard

__all__ = ["LiveScreen"]


class LiveScreen(Screen[None]):
    """Subclasses implement ``read()`` as an exclusive ``@work`` and call ``start_refreshing()`` on mount.

    ``reload()`` (a refresh asked for, a new filter, an action) starts a read that supersedes the one in
    flight. The periodic refresh never does: a read can take longer than the interval (a long history, a
    busy database), and cancelling it at every tick would leave the screen without data for good. A tick
    that finds a read still running marks the status line as waiting for storage instead. A screen under
    another one skips its ticks.
    """

    def __init__(self) -> None:
        super().__init__()
        self._reading: Worker[None] | None = None
        self._read_started: datetime | None = None
        self._read_since = 0.0

    @property
    def dashboard(self) -> RunlaneDashboard:
        return self.app  # type: ignore[return-value]

    @property
    def status_line(self) -> StatusLine:
        return self.query_one("#status-line", StatusLine)

    def read(self) -> Worker[None]:
        """Read the screen's data and show it: each screen defines it, as an exclusive ``@work``."""
        raise NotImplementedError(f"{type(self).__name__} must define read()")

    def start_refreshing(self) -> None:
        self.reload()
        if self.dashboard.refresh_interval > 0:
            self.set_interval(self.dashboard.refresh_interval, self._tick)

    def reload(self) -> None:
        """Read now, superseding a read in flight."""
        self._read_started = self.dashboard.now()  # shown to the operator
        self._read_since = time.monotonic()  # measured
        self.dashboard.show_source()  # the client may have followed a restarted runlane dev
        self._reading = self.read()

    @property
    def reading(self) -> bool:
        """Whether a read is in flight."""
        return self._reading is not None and not self._reading.is_finished

    def refresh_if_idle(self) -> None:
        """Read unless a read is in flight."""
        if not self.reading:
            self.reload()

    def _tick(self) -> None:
        if not self.is_current:
            return
        started = self._read_started
        if self.reading and started is not None:
            if time.monotonic() - self._read_since >= self.dashboard.refresh_interval:
                # The read has run for a whole interval at least: the rows on screen may be old.
                self.status_line.waiting(started)
        self.refresh_if_idle()
