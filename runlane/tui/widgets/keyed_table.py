"""``KeyedTable``: a row-cursor ``DataTable`` whose rows are keyed, so a refresh keeps the cursor's row."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.text import Text
from textual.widgets import DataTable

__all__ = ["KeyedTable"]


class KeyedTable(DataTable[Text | str]):
    """Subclasses add their columns on mount and fill rows inside ``with self.replacing_rows():``."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True

    @property
    def cursor_key(self) -> str | None:
        """The key of the row under the cursor, if any."""
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:  # the cursor sits on no row
            return None

    @contextmanager
    def replacing_rows(self) -> Iterator[None]:
        """Clear the rows for the block to add new ones, then put the cursor back on the same key."""
        cursor = self.cursor_key
        self.clear()
        yield
        if cursor is not None and cursor in self.rows:
            self.move_cursor(row=self.get_row_index(cursor))
