"""``ConfirmScreen``: a yes/no question in front of an operator action."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from ..format import printable_text

__all__ = ["ConfirmScreen"]


class ConfirmScreen(ModalScreen[bool]):
    """Dismissed with ``True`` (y, or the action's button) or ``False`` (n, escape, or Keep)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "No", show=False),
    ]

    def __init__(self, question: str, *, action: str) -> None:
        super().__init__()
        self.question = question
        self.action_label = action

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(printable_text(self.question), id="question")
            with Horizontal(id="answers"):
                yield Button(f"{self.action_label} (y)", variant="error", id="yes")
                yield Button("Keep (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def _no(self) -> None:
        self.dismiss(False)

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)
