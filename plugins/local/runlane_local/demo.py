"""The quick start, then a short tour of what a run records, on the in-memory lane.

    ./dev demo

Part 1 is the smallest durable program (it prints ``queued``, ``succeeded``, ``["user_123"]``).
Part 2 drains a backlog with a worker: one task retries once before succeeding (its failed attempt
shows as a ``runlane.task`` log line), one releases the run to wait for a signal, and the event history
of each run is printed from the operator API.
Part 3 does it from the command line in a temporary directory: ``runlane init config`` (a durable
SQLite lane by default), ``runlane trigger``, then ``runlane dev --once``, which materializes the
scheduled run and executes both, and ``runlane runs list`` from yet another process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pydantic import BaseModel

from runlane import Backoff, RetryBackoffType, Retry, RunEventSortField, SortDirection, WorkerMode, create_runlane, queue, task
from runlane.testing import ControlledClock

from .lane import local_lane

if TYPE_CHECKING:
    from runlane import RunRecord, Runlane

# -- Part 1: the quick start -------------------------------------------------------------------

sent_welcome_emails: list[str] = []
email_queue = queue("emails", default=True)


class Welcome(BaseModel):
    user_id: str


@task("emails.welcome", queue=email_queue)
def send_welcome_email(payload: Welcome) -> None:  # a plain def runs in a worker thread
    sent_welcome_emails.append(payload.user_id)


async def quick_start() -> None:
    runlane = create_runlane(lane=local_lane(), queues=[email_queue], tasks={"send_welcome_email": send_welcome_email})
    async with runlane:
        result = await runlane.trigger(runlane.tasks.send_welcome_email, {"user_id": "user_123"})
        completed = await runlane.execute_next()
        print(result.run.status)
        print(completed.status if completed else None)
        print(json.dumps(sent_welcome_emails))


# -- Part 2: a worker, a retry, a business wait ------------------------------------------------

reports = queue("reports", default=True)
flaky_calls: dict[str, int] = {}


class Invoice(BaseModel):
    invoice_id: str


@task("invoices.sync", queue=reports,
      retry=Retry(max_attempts=3, backoff=Backoff(type=RetryBackoffType.EXPONENTIAL, delay="5s", max_delay="1m")))
async def sync_invoice(payload: Invoice) -> dict:
    flaky_calls[payload.invoice_id] = flaky_calls.get(payload.invoice_id, 0) + 1
    if flaky_calls[payload.invoice_id] == 1:
        raise ConnectionError("provider timed out")  # persisted as task_failed, then retried
    return {"synced": payload.invoice_id}


ready_reports: set[str] = set()


class Report(BaseModel):
    report_id: str


@task("reports.publish", queue=reports)
async def publish_report(payload: Report, ctx) -> dict | None:
    if payload.report_id not in ready_reports:
        return ctx.wait_for_signal(f"report_ready_{payload.report_id}", timeout="1h", reason="waiting_for_webhook")
    return {"published": payload.report_id}


class _OneLineLog(logging.Handler):
    """The runtime's log records as one line each (an application configures logging its own way)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"  log {record.name} {record.levelname.lower()}: {record.getMessage()}")


async def tour() -> None:
    log = logging.getLogger("runlane")
    handler = _OneLineLog()
    log.addHandler(handler)
    try:
        await _tour()
    finally:
        log.removeHandler(handler)


async def _tour() -> None:
    clock = ControlledClock()
    runlane = create_runlane(lane=local_lane(), queues=[reports], tasks=[sync_invoice, publish_report], clock=clock)
    async with runlane:
        invoice = (await runlane.trigger(sync_invoice, {"invoice_id": "inv_42"})).run
        report = (await runlane.trigger(publish_report, {"report_id": "r_7"})).run
        await runlane.worker(mode=WorkerMode.DRAIN, concurrency=4).closed
        print(f"  after the first drain: invoice {(await _stored_run(runlane, invoice.id)).status},"
              f" report {(await _stored_run(runlane, report.id)).status}")

        clock.advance("5s")                       # the retry's backoff has passed
        ready_reports.add("r_7")                  # the webhook arrives; its data lives in the app
        resumed = await runlane.signals.send("report_ready_r_7")
        ticked = await runlane.tick()             # maintenance requests delivery for the due retry
        await runlane.worker(mode=WorkerMode.DRAIN, concurrency=4).closed
        print(f"  signal resumed {len(resumed)} run; tick requested {ticked.delivery_requested} delivery")

        for run_id in (invoice.id, report.id):
            run = await _stored_run(runlane, run_id)
            page = await runlane.runs.events(run_id, sort_by=RunEventSortField.SEQUENCE, sort_direction=SortDirection.ASC)
            print(f"\n  {run.task_id}: {run.status}, attempts={run.counters.attempts}"
                  f" failures={run.counters.failures} releases={run.counters.releases} output={run.output}")
            for record in page.data:
                print(f"    #{record.sequence:<2} {record.event.occurred_at:%H:%M:%S}  {record.event.type}")


async def _stored_run(runlane: Runlane, run_id: str) -> RunRecord:
    """A run the tour triggered, as stored now (the tour deletes no run)."""
    return cast("RunRecord", await runlane.runs.get(run_id))


# -- Part 3: the same from the command line ---------------------------------------------------

CLI_TASKS = """\
from runlane import queue, schedule, task

default = queue("default", default=True)


@task("hello.greet", queue=default, schedule=schedule("hello.every_minute", every="1m", payload={"name": "ada"}))
def greet(payload: dict) -> dict:
    return {"greeting": f"hello {payload['name']}"}
"""


def cli_tour() -> None:
    """`runlane init config`, a tasks module, `trigger`, `dev --once` and `runs list` in a fresh directory."""
    runlane = [sys.executable, "-m", "runlane"]
    with tempfile.TemporaryDirectory(prefix="runlane-demo-") as directory:
        project = Path(directory)
        (project / "demo_tasks.py").write_text(CLI_TASKS)
        commands = (
            ["init", "config", "--tasks", "demo_tasks"],
            ["trigger", "hello.greet", '{"name": "grace"}'],
            ["dev", "--once"],
            ["runs", "list"],
        )
        for command in commands:
            print(f"  $ runlane {' '.join(shlex.quote(part) for part in command)}")
            completed = subprocess.run(
                [*runlane, *command], cwd=project, capture_output=True, text=True, timeout=60, check=False
            )
            for line in (completed.stdout + completed.stderr).splitlines():
                print(f"    {line}")
            if completed.returncode != 0:
                raise SystemExit(completed.returncode)


async def main() -> None:
    await quick_start()
    print("\nA worker draining a backlog (in-memory lane, controlled clock):")
    await tour()
    print("\nThe same from the command line, in a fresh directory:")
    cli_tour()


if __name__ == "__main__":
    asyncio.run(main())
