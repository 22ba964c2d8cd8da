"""How the dashboard shows statuses and times (Rich text, no Textual).

Every string the dashboard shows that it does not write itself (ids, keys, reasons, outputs, messages)
becomes Rich text through ``printable_text()`` and a plain string through ``printable()``, as in the CLI:
control characters in them are shown escaped, never sent to the terminal.
"""

from __future__ import annotations

from datetime import UTC, datetime

from rich.text import Text

from ..cli.output import printable, printable_text
from ..errors import RunlaneError

__all__ = ["STATUS_STYLES", "error_text", "printable", "printable_text", "short_time", "status_text"]

STATUS_STYLES = {
    "scheduled": "cyan",
    "queued": "blue",
    "running": "bold yellow",
    "retrying": "yellow",
    "released": "magenta",
    "cancellation_requested": "red",
    "succeeded": "green",
    "failed": "bold red",
    "cancelled": "dim",
}


def error_text(error: RunlaneError) -> Text:
    """``code: message`` with the code in red; the message as it is (never read as markup)."""
    return Text.assemble((error.code.value, "red"), printable(f": {error.message}"))


def status_text(status: object) -> Text:
    value = str(getattr(status, "value", status))
    return printable_text(value.replace("_", " "), STATUS_STYLES.get(value, ""))


def short_time(value: datetime | None) -> str:
    """``2026-11-30 08:00:01`` in UTC (the dashboard's one time zone), or an empty string."""
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
