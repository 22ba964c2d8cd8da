"""Messages the dashboard's screens send each other."""

from __future__ import annotations

from textual.message import Message

__all__ = ["RunChanged"]


class RunChanged(Message):
    """An action changed ``run_id`` (or created ``created_run_id``): views showing runs reload."""

    def __init__(self, run_id: str, created_run_id: str | None = None) -> None:
        super().__init__()
        self.run_id = run_id
        self.created_run_id = created_run_id
