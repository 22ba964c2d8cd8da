"""How the dashboard shows statuses and times (Rich text, no Textual).

Every string the dashboard shows that it does not write itself (ids, keys, reasons, outputs, messages)
becomes Rich text through ``printable_text()`` and a plain string through ``printable()``, as in the CLI:
control characters in them are shown escaped, never sent to the terminal.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from rich.text import Text

from ..cli.output import printable, printable_text, to_json_value
from ..errors import RunlaneError

__all__ = [
    "STATUS_STYLES",
    "clock_time",
    "error_text",
    "json_text",
    "printable",
    "printable_text",
    "short_time",
    "status_text",
]

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


def clock_time(value: datetime) -> str:
    """``08:00:01 UTC``: when the dashboard did something today."""
    return value.astimezone(UTC).strftime("%H:%M:%S UTC")


def json_text(value: Any, *, width: int = 80) -> Text:
    """``value`` as JSON over as many lines as it needs: an object or an array of objects or arrays that
    does not fit in ``width`` columns gets one member per line, indented; the rest stays on one line (to
    be wrapped where it is shown). Each line is made ``printable()``: JSON escapes the C0 controls but
    not the C1 ones or the bidirectional formatting characters."""
    lines = _json_lines(to_json_value(value), 0, 0, width)
    return Text("\n".join(printable(line) for line in lines))


def _json_lines(node: Any, indent: int, lead: int, width: int) -> list[str]:
    """``node`` as lines: the first one goes after ``lead`` columns of the caller's line, the others are
    indented from ``indent``."""
    flat = json.dumps(node, ensure_ascii=False, separators=(", ", ": "))
    nested = isinstance(node, dict) or (isinstance(node, list) and any(isinstance(item, dict | list) for item in node))
    if not nested or not node or lead + len(flat) <= width:
        return [flat]
    pad = " " * (indent + 2)
    if isinstance(node, dict):
        members = [(f"{json.dumps(key, ensure_ascii=False)}: ", item) for key, item in node.items()]
    else:
        members = [("", item) for item in node]
    lines = ["{" if isinstance(node, dict) else "["]
    for index, (key, item) in enumerate(members):
        inner = _json_lines(item, indent + 2, len(pad) + len(key), width)
        inner[0] = pad + key + inner[0]
        if index < len(members) - 1:
            inner[-1] += ","
        lines.extend(inner)
    lines.append(" " * indent + ("}" if isinstance(node, dict) else "]"))
    return lines
