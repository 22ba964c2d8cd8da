"""``StatusLine``: the line under a screen's tables: what the screen shows, and how fresh it is."""

from __future__ import annotations

from datetime import datetime

from rich.text import Text
from textual.app import RenderResult
from textual.widgets import Static

from ...errors import RunlaneError
from ..format import clock_time, error_text

__all__ = ["StatusLine"]

_SEPARATOR = "  ·  "
_ROOM = 12
"""The fewest columns a cut message or error keeps before the refresh time; with fewer it is left out."""


class StatusLine(Static):
    """``what the screen shows  ·  refreshed 08:00:01 UTC``.

    A read that failed shows its error in place of the message, with the time of the last refresh that
    worked (the rows on screen are from then); a read still running a refresh interval after it started
    adds ``refreshing… waiting for storage since …``, so rows from storage that stopped answering are
    never taken for live ones.

    The line keeps to one row of its width and the refresh time always shows: a message or error too long
    to fit before it is cut with an ellipsis (an error stays whole in the line's tooltip).
    """

    def __init__(self, *, id: str = "status-line") -> None:
        super().__init__("", id=id)
        self.message = Text("")
        self.error: RunlaneError | None = None
        self.refreshed_at: datetime | None = None
        self.waiting_since: datetime | None = None

    def show_message(self, message: Text) -> None:
        """What the screen shows (counts, paging keys); kept until the next message."""
        self.message = message
        self._redraw()

    def refreshed(self, at: datetime) -> None:
        """A read finished at ``at``: its rows are on screen."""
        self.refreshed_at, self.error, self.waiting_since = at, None, None
        self._redraw()

    def failed(self, error: RunlaneError) -> None:
        """A read failed: the rows on screen stay, from the last refresh."""
        self.error, self.waiting_since = error, None
        self._redraw()

    def waiting(self, since: datetime) -> None:
        """The read started at ``since`` is still running."""
        self.waiting_since = since
        self._redraw()

    def _redraw(self) -> None:
        self.tooltip = error_text(self.error) if self.error is not None else None
        self.refresh()

    def render(self) -> RenderResult:
        head = error_text(self.error) if self.error is not None else self.message.copy()
        times = Text()
        parts: list[tuple[str, str]] = []
        if self.refreshed_at is not None:
            parts.append((f"refreshed {clock_time(self.refreshed_at)}", "dim"))
        if self.waiting_since is not None:
            parts.append((f"refreshing… waiting for storage since {clock_time(self.waiting_since)}", "yellow"))
        for text, style in parts:
            if times.plain:
                times.append(_SEPARATOR, style="dim")
            times.append(text, style=style)
        return _fit(head, times, self.content_size.width)


def _fit(head: Text, times: Text, width: int) -> Text:
    """``head  ·  times`` in ``width`` columns (any width if 0, before the first layout): ``head`` is cut
    first, then left out, so that ``times`` (what tells the rows' age) shows as long as it fits at all."""
    if not times.plain:
        line = head
    elif not head.plain:
        line = times
    else:
        line = Text.assemble(head, (_SEPARATOR, "dim"), times)
        room = width - len(_SEPARATOR) - times.cell_len
        if width and line.cell_len > width:
            if room >= _ROOM:
                head.truncate(room, overflow="ellipsis")
                line = Text.assemble(head, (_SEPARATOR, "dim"), times)
            else:
                line = times
    if width:
        line.truncate(width, overflow="ellipsis")
    line.no_wrap = True
    return line
