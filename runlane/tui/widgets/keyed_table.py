"""``KeyedTable``: a ``DataTable`` whose rows are keyed, so a refresh changes only the rows that changed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Self

from rich.text import Text
from textual import events
from textual.widgets import DataTable
from textual.widgets.data_table import CursorType

__all__ = ["Cell", "KeyedTable"]

Cell = Text | str


class KeyedTable(DataTable[Cell]):
    """Subclasses add their columns on mount and show their rows with ``show_rows()``."""

    def __init__(self, *, id: str | None = None, cursor_type: CursorType = "row") -> None:
        super().__init__(id=id, cursor_type=cursor_type, zebra_stripes=True)
        self._shown: dict[str, tuple[Cell, ...]] = {}

    @property
    def cursor_key(self) -> str | None:
        """The key of the row under the cursor, if any."""
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:  # the cursor sits on no row
            return None

    def show_rows(self, rows: Iterable[tuple[str, Sequence[Cell]]]) -> None:
        """Show ``rows`` (key, cells), in order, keeping the cursor on the same key.

        Rows shown already with the same cells are left alone and changed cells are updated in place, so
        refreshing a long table that barely changed costs little; the table is rebuilt only when a new row
        goes before one shown already (a ``DataTable`` only appends) or most rows go.
        """
        wanted = {key: tuple(cells) for key, cells in rows}
        cursor = self.cursor_key
        kept = [key for key in self._shown if key in wanted]
        added = [key for key in wanted if key not in self._shown]
        gone = [key for key in self._shown if key not in wanted]
        shown = self._shown
        if kept + added != list(wanted) or len(gone) > len(kept):
            self.clear()
            kept, added = [], list(wanted)
        else:
            for key in gone:
                self.remove_row(key)
        columns = list(self.columns)
        for key in kept:
            for column, old, new in zip(columns, shown[key], wanted[key]):
                if _cell_key(old) != _cell_key(new):
                    self.update_cell(key, column, new, update_width=True)
        for key in added:
            self.add_row(*wanted[key], key=key)
        self._shown = wanted
        if cursor is not None and cursor in self.rows:
            self.move_cursor(row=self.get_row_index(cursor))

    def clear(self, columns: bool = False) -> Self:
        self._shown = {}
        return super().clear(columns)

    async def _on_idle(self, event: events.Idle) -> None:
        """Measure new rows, as ``DataTable`` does when idle, and paint every line again if a column grew.

        ``DataTable`` keeps the lines it rendered before measuring (a repaint came first on a busy machine)
        and, with rows of a fixed height, goes on showing them cut to the old widths, header included.
        Textual then calls ``DataTable``'s own handler too, which finds nothing left to measure.
        """
        widths = [column.content_width for column in self.columns.values()]
        await super()._on_idle(event)
        if [column.content_width for column in self.columns.values()] != widths:
            self._clear_caches()
            self.refresh()


def _cell_key(cell: Cell) -> tuple[object, ...]:
    """What a cell shows: ``Text`` equality ignores its base style (a status's colour, say)."""
    if isinstance(cell, Text):
        return (cell.plain, str(cell.style), tuple(cell.spans))
    return (cell,)
