"""Where the dashboard gets its data: the CLI's stateful operations, run here or in ``runlane dev``.

The dashboard never calls storage or the runtime's internals. It runs the same registered operations
as ``runlane runs list``, ``runs get``, ``runs attempts``, ``queues``, ``cancel``, ``retry`` and
``rerun`` (``runlane.cli.main.OPERATIONS``), rendered as JSON, and parses that JSON back into the
public record models. On a shared lane the operations run on a runtime in this process; on a
process-local lane with a live ``runlane dev`` session they run inside that process, through the
same loopback bridge the other commands use. Either way the dashboard sees exactly what ``--json``
prints.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cli import actions as cli_actions
from ..cli import queues as cli_queues
from ..cli import runs as cli_runs
from ..cli.bridge import Session, exchange, render_operation
from ..cli.main import OPERATIONS, parse_params
from ..cli.output import Output
from ..errors import ErrorCode, RunlaneError
from ..models import RunAttemptSummary, RunEventRecord, RunRecord, RunSummary

__all__ = ["DashboardClient", "QueueRow", "RunDetail", "RunsPage"]

# One page of events covers nearly every run; for a longer history the detail screen shows the newest
# page, in order, and says how many earlier events there are.
EVENTS_PAGE = 100
RUNS_PAGE = 100
ACTOR_ID = "dashboard"
"""The operator actor id recorded on the events of actions taken in the dashboard."""

Call = Callable[[str, dict[str, Any]], Awaitable[str]]

_READS = frozenset({"queues", "runs list", "runs get", "runs attempts"})

_OPERATION_MODULES = (cli_actions, cli_queues, cli_runs)
"""The modules whose import registers the operations the client runs in ``OPERATIONS``: imported here so the
client works whatever else was imported."""


def _dev_where(session: Session) -> str:
    return f"runlane dev (pid {session.pid})"


@dataclass(frozen=True, slots=True)
class QueueRow:
    """One line of the queue overview (``runlane queues``)."""

    name: str
    default: bool
    concurrency_limit: int | None
    counts: dict[str, int]
    more: bool
    capped: tuple[str, ...] = ()  # the statuses with more runs than were counted
    registered: bool = True  # false: runs of a queue this project does not register (no worker claims them)


@dataclass(frozen=True, slots=True)
class RunsPage:
    runs: list[RunSummary]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class RunDetail:
    run: RunRecord
    events: list[RunEventRecord]
    earlier_events: int  # events before the first one shown (only the newest page is read)
    attempts: list[RunAttemptSummary]


class DashboardClient:
    """Typed reads and actions for the dashboard. Build it with ``local()`` or ``bridged()``.

    ``where`` says where the operations run, for the dashboard's title.
    """

    def __init__(self, call: Call, *, lane: str, environment: str, where: str) -> None:
        self._call = call
        self.lane = lane
        self.environment = environment
        self.where = where

    @classmethod
    def local(cls, runtime: Any) -> DashboardClient:
        """Operations on ``runtime``, a started ``Runlane`` of this process."""

        async def call(name: str, params: dict[str, Any]) -> str:
            op = OPERATIONS[name]
            stdout, _ = await render_operation(runtime, op, parse_params(op, params), json_mode=True)
            return stdout

        return cls(call, lane=runtime.lane.name, environment=runtime.environment.name, where="this process")

    @classmethod
    def bridged(
        cls,
        session: Session,
        *,
        lane: str,
        environment: str,
        find_session: Callable[[], Session | None] | None = None,
    ) -> DashboardClient:
        """Operations run inside the ``runlane dev`` process of ``session``. ``find_session`` gives the
        session now recorded for the configuration: ``runlane dev --reload`` starts a new process (a new
        port and token) at every change, and the client follows it once the old one no longer answers."""
        current = session

        async def call(name: str, params: dict[str, Any]) -> str:
            nonlocal current
            op = OPERATIONS[name]
            parsed = parse_params(op, params)
            # The screen's periodic reads stay out of the dev process's output; its actions are printed there.
            quiet = name in _READS
            rendered = await exchange(current, op, parsed, Output(json_mode=True), quiet=quiet)
            if rendered is None and find_session is not None:
                found = find_session()
                if found is not None and found != current:
                    current = found
                    client.where = _dev_where(found)
                    client.environment = found.environment or client.environment
                    client.lane = found.lane_name or client.lane
                    rendered = await exchange(current, op, parsed, Output(json_mode=True), quiet=quiet)
            if rendered is None:
                raise RunlaneError(
                    ErrorCode.STORAGE_UNAVAILABLE,
                    f"The runlane dev process (pid {current.pid}) no longer answers; start runlane dev again "
                    "and the dashboard reconnects at its next refresh.",
                    retryable=True,
                )
            return rendered.stdout

        client = cls(call, lane=lane, environment=environment, where=_dev_where(session))
        return client

    async def _json(self, name: str, **params: Any) -> Any:
        text = await self._call(name, params)
        try:
            return json.loads(text)
        except ValueError:
            raise RunlaneError(
                ErrorCode.INTERNAL_ERROR, f"The {name!r} operation did not answer with JSON: {text[:200]!r}"
            ) from None

    # -- reads ----------------------------------------------------------------------------------

    async def queues(self) -> list[QueueRow]:
        document = await self._json("queues")
        return [
            QueueRow(
                name=row["name"],
                default=row["default"],
                concurrency_limit=row["concurrency_limit"],
                counts=row["counts"],
                more=row["more"],
                # A runlane dev process of a version without "capped" only says whether any count was capped.
                capped=tuple(row.get("capped", list(row["counts"]) if row["more"] else ())),
                registered=row.get("registered", True),
            )
            for row in document["queues"]
        ]

    async def runs(
        self,
        *,
        statuses: Sequence[str] = (),
        queues: Sequence[str] = (),
        cursor: str | None = None,
        limit: int = RUNS_PAGE,
    ) -> RunsPage:
        document = await self._json(
            "runs list", status=list(statuses) or None, queue=list(queues) or None, cursor=cursor, limit=limit
        )
        return RunsPage([RunSummary.model_validate(row) for row in document["data"]], document["next_cursor"])

    async def run_record(self, run_id: str) -> RunRecord:
        """The run alone, without its history: cheap enough to ask whether anything changed."""
        document = await self._json("runs get", run_id=run_id)
        return RunRecord.model_validate(document["run"])

    async def run(self, run_id: str) -> RunDetail:
        """The run with its newest page of events and all its attempts."""
        document = await self._json(
            "runs get", run_id=run_id, events=True, limit=EVENTS_PAGE, events_direction="desc"
        )
        attempts = await self._json("runs attempts", run_id=run_id)
        events = document.get("events") or {"data": [], "next_cursor": None}
        newest = [RunEventRecord.model_validate(row) for row in events["data"]]
        run = RunRecord.model_validate(document["run"])
        shown = newest[::-1]  # oldest first, as a timeline reads
        earlier = shown[0].sequence - 1 if shown and events["next_cursor"] is not None else 0
        return RunDetail(
            run=run,
            events=shown,
            earlier_events=earlier,
            attempts=[RunAttemptSummary.model_validate(row) for row in attempts["attempts"]],
        )

    # -- actions --------------------------------------------------------------------------------

    async def cancel(self, run_id: str, *, reason: str | None = None) -> RunRecord:
        document = await self._json("cancel", run_id=run_id, reason=reason, actor_id=ACTOR_ID)
        return RunRecord.model_validate(document["run"])

    async def retry(self, run_id: str) -> RunRecord:
        """A new run retrying ``run_id``, a failed run."""
        document = await self._json("retry", source_run_id=run_id, actor_id=ACTOR_ID)
        return RunRecord.model_validate(document["run"])

    async def rerun(self, run_id: str) -> RunRecord:
        """A new run with the payload of ``run_id``, a finished run."""
        document = await self._json("rerun", source_run_id=run_id, actor_id=ACTOR_ID)
        return RunRecord.model_validate(document["run"])
