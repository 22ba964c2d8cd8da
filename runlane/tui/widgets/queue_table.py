"""``QueueTable``: every queue with its active runs by status (``runlane queues``)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from ...cli.output import queue_label, queue_limit_label
from ...cli.queues import ACTIVE_STATUSES
from ..client import QueueRow
from ..format import STATUS_STYLES
from .keyed_table import Cell, KeyedTable

__all__ = ["QueueTable"]

_STATUSES = tuple(status.value for status in ACTIVE_STATUSES)
_HEADINGS = tuple("cancelling" if status == "cancellation_requested" else status for status in _STATUSES)


class QueueTable(KeyedTable):
    """One row per queue, keyed by queue name; the selected row filters the runs table."""

    def on_mount(self) -> None:
        self.add_column("queue", key="queue")
        self.add_column("limit", key="limit")
        for status, heading in zip(_STATUSES, _HEADINGS):
            self.add_column(heading, key=status)

    def show(self, rows: Sequence[QueueRow], selected: str | None) -> None:
        """Show ``rows``, keeping the cursor on the same queue; ``selected`` is the queue filter.

        A count is exact unless its status had more runs than were counted: then it shows ``+``. A queue
        this project does not register (its runs are claimed by no worker here) is marked as such.
        """
        self.show_rows((row.name, self._cells(row, selected)) for row in rows)

    @staticmethod
    def _cells(row: QueueRow, selected: str | None) -> list[Cell]:
        name = queue_label(
            row.name, default=row.default, registered=row.registered, style="bold" if row.name == selected else ""
        )
        if row.name == selected:
            name.append(" ◂ filter", style="cyan")
        cells: list[Cell] = [name, queue_limit_label(row.concurrency_limit, registered=row.registered)]
        for status in _STATUSES:
            count = row.counts.get(status, 0)
            label = f"{count}{'+' if status in row.capped else ''}"
            cells.append(Text(label, style=STATUS_STYLES[status] if count else "dim"))
        return cells
