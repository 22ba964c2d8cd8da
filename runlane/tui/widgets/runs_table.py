"""``RunsTable``: the newest runs, one row each, keyed by run id."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from ...models import RunSummary
from ..format import printable_text, short_time, status_text
from .keyed_table import KeyedTable

__all__ = ["RunsTable"]


class RunsTable(KeyedTable):
    """Runs as rows; ``show()`` keeps the cursor on the same run across refreshes."""

    def on_mount(self) -> None:
        for label, key in (
            ("run", "id"),
            ("status", "status"),
            ("task", "task"),
            ("queue", "queue"),
            ("attempts", "attempts"),
            ("updated (UTC)", "updated"),
            ("detail", "detail"),
        ):
            self.add_column(label, key=key)

    def show(self, runs: Sequence[RunSummary]) -> None:
        """Replace the rows, keeping the cursor on the same run."""
        self.show_rows(
            (
                run.id,
                (  # user strings as Text: a str cell would be read as markup
                    printable_text(run.id),
                    status_text(run.status),
                    printable_text(run.task_id),
                    printable_text(run.queue),
                    str(run.counters.attempts),
                    short_time(run.updated_at),
                    _detail(run),
                ),
            )
            for run in runs
        )


def _detail(run: RunSummary) -> Text:
    """Why a run is where it is: its failure, what it waits for, or when it runs."""
    if run.failure is not None:
        return printable_text(f"{run.failure.code.value}: {run.failure.message}", "red")
    wait = run.wait
    if wait is not None:
        kind = str(getattr(wait.type, "value", wait.type))
        if kind == "signal":
            return printable_text(f"waiting for signal {getattr(wait, 'signal_key', '')}", "magenta")
        if kind == "run_completion":
            return printable_text(f"waiting for run {getattr(wait, 'run_id', '')}", "magenta")
        return Text(f"resumes {short_time(getattr(wait, 'resume_at', None))} UTC", style="magenta")
    if run.run_at is None:
        return Text("")
    # A delayed trigger stays queued with a later run_at (a worker claims it once due): said, so that it is
    # not taken for work that should be running already.
    delayed = run.status.value == "queued" and run.run_at > run.updated_at
    if run.status.value in ("scheduled", "retrying") or delayed:
        return Text(f"runs at {short_time(run.run_at)} UTC", style="dim")
    return Text("")
