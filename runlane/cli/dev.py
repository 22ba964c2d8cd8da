"""``runlane dev``: a poll worker plus a maintenance loop in one process, for local development.

``--once`` runs one tick, drains due work, runs one export per ``[[exporters]]`` entry and exits. The
long-running form ticks every ``--tick-interval`` (default ``[dev] tick_interval``) next to a poll worker
and one exporter loop per ``[[exporters]]`` entry, and stops all of them cooperatively on SIGINT/SIGTERM.
Exporter sinks are built (and their options validated) before anything starts. A sink's records are
JSON objects without ``type``/``at``, so they stay distinguishable from dev's own lifecycle lines. On a
process-local lane it also serves the loopback control bridge (``bridge``), so stateful commands from
another terminal run against this process's in-memory state. ``--reload`` runs all of this in a child
process and restarts it when the project's code or config changes (``reload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Annotated, Any

import typer

from ..core.cancellation import CancellationController
from ..durations import duration_ms
from ..vocabulary import WorkerMode
from .main import (
    COMMAND_LINE,
    configured_exporters,
    guard,
    load_cli_config,
    on_forced_exit,
    state_of,
    with_runtime,
)
from .options import (
    DURATION,
    CancellationFinalizationLimit,
    ConcurrencyOption,
    DeliveryRequestLimit,
    DispatchReservationLimit,
    EmptyPollDelayOption,
    HealthFileOption,
    MultiValueCommand,
    OutboxClaimLimit,
    QueuesOption,
    ScheduleMaterializationLimit,
    TickLimits,
    TimeoutFinalizationLimit,
    WorkerIdOption,
    max_runs_option,
)
from .export import close_sinks, export_pending, start_exporter, stop_exporters
from .reload import RELOAD_CHILD_ENV, Reloader, child_command
from .tick import tick_until_stopped
from .work import StopOnSignals, interrupted_status, run_worker

__all__ = ["app"]

app = typer.Typer()


@app.command("dev", cls=MultiValueCommand, short_help="Run a worker, maintenance and [[exporters]], for development.")
def dev(
    ctx: typer.Context,
    once: bool = typer.Option(False, "--once", help="One maintenance tick, drain due work, exit."),
    queue: QueuesOption = None,
    concurrency: ConcurrencyOption = 1,
    max_runs: Annotated[int | None, max_runs_option("--once")] = None,
    empty_poll_delay: EmptyPollDelayOption = None,
    tick_interval: str | None = typer.Option(
        None,
        "--tick-interval",
        help="Maintenance interval (default [dev] tick_interval).",
        metavar="D",
        callback=DURATION,
    ),
    schedule_materialization_limit: ScheduleMaterializationLimit = None,
    delivery_request_limit: DeliveryRequestLimit = None,
    cancellation_finalization_limit: CancellationFinalizationLimit = None,
    timeout_finalization_limit: TimeoutFinalizationLimit = None,
    outbox_claim_limit: OutboxClaimLimit = None,
    dispatch_reservation_limit: DispatchReservationLimit = None,
    worker_id: WorkerIdOption = None,
    reload: bool = typer.Option(
        False, "--reload", help="Restart when a *.py file under the config's directory or the config changes."
    ),
    health_file: HealthFileOption = None,
) -> None:
    """Run a worker, the maintenance loop and the [[exporters]] for local development."""
    output = state_of(ctx).output
    if reload:
        _reload(ctx, once)
    limits = TickLimits.of(
        schedule_materialization_limit,
        delivery_request_limit,
        cancellation_finalization_limit,
        timeout_finalization_limit,
        outbox_claim_limit,
        dispatch_reservation_limit,
    )

    if once and empty_poll_delay is not None:
        ctx.fail("--empty-poll-delay applies only without --once.")
    if not once and max_runs is not None:
        ctx.fail("--max-runs applies only with --once.")
    if once and tick_interval is not None:
        ctx.fail("--tick-interval applies only without --once: --once ticks once.")
    # --tick-interval is checked by its callback, [dev] tick_interval by the config loader.
    interval = tick_interval or guard(ctx, lambda: load_cli_config(ctx)).dev.tick_interval
    interval_s = duration_ms(interval, "--tick-interval") / 1000
    worker_options: dict[str, Any] = {"queues": queue or None, "concurrency": concurrency, "worker_id": worker_id}
    # Unknown exporter names and invalid exporter options fail here, before a runtime or loop starts.
    exporters = guard(ctx, lambda: configured_exporters(load_cli_config(ctx)))

    async def body(runtime: Any) -> int:
        try:
            # What the worker would reject fails before the first tick, the bridge or an exporter.
            _check_worker_options(runtime, **worker_options)
            with StopOnSignals(output) as stop:
                if once:
                    await _once(runtime, stop, limits, max_runs=max_runs, **worker_options)
                    return interrupted_status(stop)
                await _loop(runtime, stop, limits, interval_s, empty_poll_delay=empty_poll_delay, **worker_options)
                return 0
        finally:
            await close_sinks(exporters)

    async def _once(runtime: Any, stop: StopOnSignals, limits: TickLimits, **worker_options: Any) -> None:
        config_path = load_cli_config(ctx).path
        from .bridge import live_dev_pid

        serving = live_dev_pid(config_path) if runtime.lane.capabilities.process_local else None
        if serving is not None:
            output.warning(
                "process_local_lane",
                f"the {runtime.lane.name!r} lane keeps runs in one process: those of {config_path.name} live in "
                f"`runlane dev` (pid {serving}), which runs them; `runlane dev --once` cannot reach them and runs "
                "on an empty lane of its own.",
            )
        output.tick_record(await runtime.tick(**limits))
        await run_worker(runtime, output, stop, mode=WorkerMode.DRAIN, **worker_options)
        for configured in exporters:
            await export_pending(runtime, output, configured)

    async def _loop(runtime: Any, stop: StopOnSignals, limits: TickLimits, interval_s: float, **options: Any) -> None:
        lane = runtime.lane
        output.record(
            "dev_started",
            f"dev started lane={lane.name} environment={runtime.environment.name} tick_interval={interval_s:g}s",
            lane=lane.name,
            environment=runtime.environment.name,
            process_local=lane.capabilities.process_local,
        )
        if lane.capabilities.process_local and os.environ.get(RELOAD_CHILD_ENV):
            # Said here, where the lane is known: a runtime factory or another plugin's lane can keep runs
            # in memory too, not only `use = "local"`.
            output.warning(
                "process_local_lane",
                f"The {lane.name!r} lane keeps runs in memory: each restart of --reload starts with none. "
                "Use the sqlite lane to keep them.",
            )
        bridge: Any = None
        forced_exit = contextlib.ExitStack()
        if lane.capabilities.process_local:
            from .bridge import BridgeServer, lane_signature

            config = load_cli_config(ctx)
            bridge = BridgeServer(
                runtime, config.path, output=output, lane=lane_signature(config), stopping=stop.stopping
            )
            session = await bridge.start()
            forced_exit.enter_context(on_forced_exit(bridge.hand_back))  # a second Ctrl-C leaves no session file
            output.record(
                "bridge_started",
                f"bridge listening on 127.0.0.1:{session.port}; stateful commands for this config run here",
                port=session.port,
                session_file=str(session.file),
            )
            if bridge.superseded is not None:
                output.warning(
                    "dev_superseded",
                    f"another runlane dev (pid {bridge.superseded.pid}) serves this config too; commands go to "
                    "this one until it stops, then to that one again (each keeps its own runs).",
                )
        exporting = CancellationController()
        loops = [(c, runtime.observation_exporter(c.consumer, c.sink)) for c in exporters]  # all built, then started
        exporter_tasks = [start_exporter(output, configured, exporter, exporting) for configured, exporter in loops]
        worker = asyncio.ensure_future(run_worker(runtime, output, stop, mode=WorkerMode.POLL, **options))
        try:
            # An exporter that fails for good stops alone (see start_exporter): the worker, maintenance and
            # the bridge go on, and with them the runs of a process-local lane.
            await tick_until_stopped(runtime, output, limits, interval_s, stop.stopping, alongside=[worker])
        finally:
            stop.stopping.set()
            exporting.abort("runlane dev is stopping")
            try:
                await worker
            finally:
                try:
                    await stop_exporters(exporter_tasks)
                finally:
                    with forced_exit:
                        if bridge is not None:
                            await bridge.close()

    status = with_runtime(ctx, body, wait_for_storage=not once, health_file=health_file)
    if status:
        raise typer.Exit(status)


def _check_worker_options(runtime: Any, *, queues: list[str] | None, concurrency: int, worker_id: str | None) -> None:
    """Reject what ``runtime.worker()`` would reject about the runtime (an unregistered queue, a bad worker
    id) before dev ticks, opens its bridge or starts exporters: the worker itself starts only after those."""
    runtime.resolve_queues(queues)
    runtime.execution_options(None, None, None, None, worker_id)


def _reload(ctx: typer.Context, once: bool) -> None:
    """Supervise ``runlane dev`` without ``--reload`` in a child process; never returns."""

    if once:
        ctx.fail("--reload applies only without --once.")
    config = guard(ctx, lambda: load_cli_config(ctx))
    output = state_of(ctx).output
    command = child_command(ctx.find_root().meta.get(COMMAND_LINE, ["dev"]))
    raise typer.Exit(Reloader(output, command, config.base_dir, config.path).run())

