"""``RunCard``: a run's fields as a labelled card, the same rows ``runlane runs get`` prints.

The payload, output and meta are shown as JSON over as many lines as they need, and every value wraps
instead of being cut at the card's width: the detail screen scrolls vertically. Up to ``SHOWN_CHARACTERS``
of each: a record may hold hundreds of kilobytes, and the card is laid out again on every scroll step.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from ...cli.output import display_value, run_rows
from ...models import RunRecord
from ..format import json_text, printable, printable_text, status_text

__all__ = ["RunCard"]

_JSON_FIELDS = frozenset({"payload", "output", "meta"})
"""The card rows that are the run attribute of the same name, JSON data ``run_rows`` compacts to one line."""

SHOWN_CHARACTERS = 20_000
"""The most of one JSON field the card shows; the rest is named, with the command that prints it whole."""


class RunCard(Static):
    """Shows one ``RunRecord``; call ``show(run)`` again to update it."""

    def show(self, run: RunRecord) -> None:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        grid.add_row("run", printable_text(run.id, "bold"))
        for label, value in run_rows(run):
            if value is None:
                continue
            cell: Text
            if label == "status":
                cell = status_text(value)
            elif label in _JSON_FIELDS:
                cell = json_text(getattr(run, label))
                hidden = len(cell.plain) - SHOWN_CHARACTERS
                if hidden > 0:
                    cell = cell[:SHOWN_CHARACTERS]
                    command = f"runlane runs get {printable(run.id)} --json"
                    cell.append(f"\n… {hidden:,} more characters: {command} prints all of it", style="dim")
            else:
                cell = printable_text(display_value(value))
            grid.add_row(label, cell)
        self.update(grid)
