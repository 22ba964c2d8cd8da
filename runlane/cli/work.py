"""``runlane work``: a storage-acquisition worker through ``runlane.worker()``, poll (default) or ``--drain``.

Also the cooperative stop used by every long-running command: the first SIGINT/SIGTERM asks the worker
to finish its current attempts and stop; a second one exits at once. This is not an SQS consumer.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Annotated, Any

import typer

from ..vocabulary import WorkerMode
from .main import (
    after_stop_signal,
    exit_now,
    load_cli_config,
    on_stop_signals,
    repeated_delivery,
    state_of,
    with_runtime,
)
from .options import (
    ConcurrencyOption,
    EmptyPollDelayOption,
    HealthFileOption,
    HeartbeatIntervalOption,
    LeaseDurationOption,
    MultiValueCommand,
    QueuesOption,
    WorkerIdOption,
    check_lease_options,
    max_runs_option,
)
from .output import Output, forward_runtime_logs, prints_as_json_logs

__all__ = ["StopOnSignals", "app", "interrupted_status", "run_worker"]

app = typer.Typer()

class StopOnSignals:
    """Turns the first SIGINT/SIGTERM into ``stopping`` (an event) and the second into an immediate exit."""

    def __init__(self, output: Output, finishing: str = "current runs") -> None:
        self.output = output
        self.finishing = finishing  # what a first signal lets finish, for the stopping line
        self.stopping = asyncio.Event()
        self.signal: signal.Signals | None = None  # the first stop signal received, if any
        self._received = 0
        self._first: tuple[signal.Signals, float] = (signal.SIGTERM, 0.0)  # the first signal, and when
        self._handlers = on_stop_signals(self._on_signal)

    def __enter__(self) -> StopOnSignals:
        self._handlers.__enter__()
        self.output.on_stdout_closed = self.stopping.set  # `runlane work | head`: stop as on SIGTERM
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.output.on_stdout_closed = None
        self._handlers.__exit__(None, None, None)
        if self._received:
            after_stop_signal(self.output, self._first)

    def _on_signal(self, signum: signal.Signals) -> None:
        if self._received and repeated_delivery(self._first, signum):
            return
        self._received += 1
        name = signal.Signals(signum).name
        if self._received == 1:
            self._first = (signum, time.monotonic())
            self.signal = signal.Signals(signum)
            self.output.record("stopping", f"received {name}; stopping after {self.finishing} (send again to exit now)",
                               signal=name)
            self.stopping.set()
            return
        exit_now(self.output, signum)


def _alone_with(runtime: Any, config_path: Any) -> str:
    """What a worker on a process-local lane should know: it sees only runs created in its own process."""
    from .bridge import live_dev_pid

    lane = runtime.lane.name
    serving = live_dev_pid(config_path)
    if serving is not None:
        return (
            f"the {lane!r} lane keeps runs in one process: those of {config_path.name} live in `runlane dev` "
            f"(pid {serving}), which this worker cannot reach. Give that dev more slots "
            "(`runlane dev --concurrency N`) instead, or use the sqlite lane to share runs between processes."
        )
    return (
        f"the {lane!r} lane keeps runs in this process only: this worker sees only runs created in it. "
        "Use `runlane dev` for a worker that the other commands reach, or the sqlite lane."
    )


async def wait_for_worker(handle: Any, stopping: asyncio.Event) -> None:
    """Wait until the worker closes on its own or a stop is requested; a failed worker raises here."""
    closed = asyncio.ensure_future(_settled(handle.closed))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({closed, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not handle.closed.done():
        await handle.stop()
    await closed
    await handle.closed


async def _settled(future: Any) -> None:
    try:
        await asyncio.shield(future)
    except Exception:
        pass  # reported by awaiting ``handle.closed`` itself


async def run_worker(
    runtime: Any,
    output: Output,
    stop: StopOnSignals,
    *,
    mode: WorkerMode,
    **options: Any,
) -> int:
    """Start a worker that prints each executed run, wait for it, print the stop line; returns runs executed."""
    executed = 0

    def on_run_executed(run: Any) -> None:
        nonlocal executed
        executed += 1
        output.run_executed(run)

    transport = runtime.lane.delivery.transport
    if transport is not None:
        output.record(
            "transport_lane",
            f"the {runtime.lane.name!r} lane publishes wakeups through {transport.name!r}: this worker polls storage "
            "and never acknowledges those messages; run the transport's consumer (runlane sqs consume) instead",
            lane=runtime.lane.name,
            transport=transport.name,
        )
    with forward_runtime_logs(output), prints_as_json_logs(output):
        handle = runtime.worker(mode=mode, on_run_executed=on_run_executed, **options)
        queues = options.get("queues") or []
        concurrency = options.get("concurrency", 1)
        output.record(
            "worker_started",
            f"worker started mode={mode.value} queues={','.join(queues) or '*'} concurrency={concurrency}",
            mode=mode.value,
            queues=list(queues),
            concurrency=concurrency,
        )
        await wait_for_worker(handle, stop.stopping)
    output.record("worker_stopped", f"worker stopped runs={executed}", runs=executed)
    return executed


@app.command("work", cls=MultiValueCommand, short_help="Run a polling worker until stopped, or drain due work.")
def work(
    ctx: typer.Context,
    drain: bool = typer.Option(False, "--drain", help="Process currently due work, then exit."),
    queue: QueuesOption = None,
    concurrency: ConcurrencyOption = 1,
    max_runs: Annotated[int | None, max_runs_option("--drain")] = None,
    empty_poll_delay: EmptyPollDelayOption = None,
    lease_duration: LeaseDurationOption = None,
    heartbeat_interval: HeartbeatIntervalOption = None,
    worker_id: WorkerIdOption = None,
    health_file: HealthFileOption = None,
) -> None:
    """Run a storage-polling worker (until stopped), or drain due work with --drain."""
    output = state_of(ctx).output
    if max_runs is not None and not drain:
        ctx.fail("--max-runs applies only with --drain.")
    if empty_poll_delay is not None and drain:
        ctx.fail("--empty-poll-delay applies only without --drain.")
    check_lease_options(ctx, lease_duration, heartbeat_interval)

    async def body(runtime: Any) -> int:
        if runtime.lane.capabilities.process_local:
            output.warning("process_local_lane", _alone_with(runtime, load_cli_config(ctx).path))
        with StopOnSignals(output) as stop:
            await run_worker(
                runtime,
                output,
                stop,
                mode=WorkerMode.DRAIN if drain else WorkerMode.POLL,
                queues=queue or None,
                concurrency=concurrency,
                max_runs=max_runs,
                empty_poll_delay=empty_poll_delay,
                lease_duration=lease_duration,
                heartbeat_interval=heartbeat_interval,
                worker_id=worker_id,
            )
            return interrupted_status(stop) if drain else 0

    status = with_runtime(ctx, body, wait_for_storage=not drain, health_file=health_file)
    if status:
        raise typer.Exit(status)


def interrupted_status(stop: StopOnSignals) -> int:
    """The exit status of a command meant to finish its work (a drain) that a stop signal ended first:
    128 + the signal's number, as a shell reports a command the signal killed, so a script can tell it
    from a drain that finished (0). A worker meant to run until stopped exits 0 on the same signal."""
    return 0 if stop.signal is None else 128 + int(stop.signal)
