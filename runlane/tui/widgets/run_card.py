"""``RunCard``: a run's fields as a labelled card, the same rows ``runlane runs get`` prints."""

from __future__ import annotations

from rich.table import Table
from textual.widgets import Static

from ...cli.output import display_value, run_rows
from ...models import RunRecord
from ..format import printable_text, status_text

__all__ = ["RunCard"]


class RunCard(Static):
    """Shows one ``RunRecord``; call ``show(run)`` again to update it."""

    def show(self, run: RunRecord) -> None:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column()
        grid.add_row("run", printable_text(run.id, "bold"))
        for label, value in run_rows(run):
            if value is None:
                continue
            grid.add_row(label, status_text(value) if label == "status" else printable_text(display_value(value)))
        self.update(grid)
