"""``runlane export``: move durable observation records to the ``[[exporters]]`` of ``runlane.toml``.

The long-running form is the exporter process of a deployment on a shared lane: one loop per
configured exporter, each keeping its own checkpoint, until SIGINT/SIGTERM. ``--once`` exports what is
pending, once per exporter, and exits. ``runlane dev`` runs the same exporters next to its worker
(and is the only place for them on a process-local lane), with the helpers below.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import typer

from ..core.cancellation import CancellationController
from ..errors import ErrorCode, RunlaneError
from ..vocabulary import RunlaneObservationExporterTickStatus
from .main import (
    ConfiguredExporter,
    configured_exporters,
    guard,
    load_cli_config,
    require_shared_lane,
    state_of,
    with_runtime,
)
from .options import HealthFileOption
from .output import Output, forward_runtime_logs
from .work import StopOnSignals, interrupted_status

__all__ = ["app", "close_sinks", "export_pending", "start_exporter", "stop_exporters"]

app = typer.Typer()

_logger = logging.getLogger("runlane.export")


@app.command("export", short_help="Move observation records to the configured [[exporters]].")
def export(
    ctx: typer.Context,
    once: bool = typer.Option(False, "--once", help="Export what is pending, once per exporter, then exit."),
    health_file: HealthFileOption = None,
) -> None:
    """Move observation records to the configured [[exporters]] until stopped (or once with --once)."""
    output = state_of(ctx).output

    def configured() -> list[ConfiguredExporter]:
        config = load_cli_config(ctx)
        exporters = configured_exporters(config)
        if not exporters:
            table = config.source.table_name("exporters")
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"No [[{table}]] in {config.path.name}; add a [[{table}]] table, for example with "
                'use = "console" and consumer = "local_console".',
            )
        return exporters

    # Unknown exporter names and invalid options fail here, before a runtime starts.
    exporters = guard(ctx, configured)
    if any(getattr(item.sink, "writes_to_stdout", False) for item in exporters):
        output.give_stdout_away()  # stdout carries one JSON record per line, for whatever reads it

    async def body(runtime: Any) -> int:
        require_shared_lane(
            runtime,
            separately="a separate exporter would read an empty store",
            dev_does="runs the [[exporters]] of that lane",
            command="runlane export",
        )
        try:
            return await run_exporters(runtime)
        finally:
            await close_sinks(exporters)

    async def run_exporters(runtime: Any) -> int:
        if once:
            # Every exporter gets its turn: each has its own checkpoint, so one failing does not hold the
            # others back. The first failure is raised once all have run (exit status 1). A first SIGINT or
            # SIGTERM stops after the current batch, a second at once: a batch may take the endpoint's whole
            # timeout, which Ctrl-C had to wait for, silently, before the command ended.
            failures: list[RunlaneError] = []
            with StopOnSignals(output, finishing="the current batch") as stop:
                for item in exporters:
                    if stop.stopping.is_set():
                        break
                    try:
                        await export_pending(runtime, output, item, stopping=stop.stopping)
                    except RunlaneError as error:
                        failures.append(error)
                        if len(exporters) > 1:
                            _record(
                                output,
                                "exporter_failed",
                                item,
                                "exporter failed",
                                f" ({error.code.value}): {error.message}",
                                error_code=error.code.value,
                            )
            if failures:
                raise failures[0]
            return interrupted_status(stop)
        controller = CancellationController()
        loops = [(item, runtime.observation_exporter(item.consumer, item.sink)) for item in exporters]
        with StopOnSignals(output, finishing="the current batch") as stop, forward_runtime_logs(output):
            tasks = [start_exporter(output, item, exporter, controller) for item, exporter in loops]
            stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.stopping.wait())
            try:
                # An exporter that fails for good stops alone (it says so): the others go on, each with its
                # own checkpoint, until the command is stopped or none is left.
                running = set(tasks)
                while running and not stopping.done():
                    done, _ = await asyncio.wait({stopping, *running}, return_when=asyncio.FIRST_COMPLETED)
                    running -= done
            finally:
                stopping.cancel()
                controller.abort("runlane export is stopping")
                await stop_exporters(tasks)
        return 0

    status = with_runtime(ctx, body, wait_for_storage=not once, health_file=health_file)
    if status:
        raise typer.Exit(status)


async def close_sinks(exporters: Sequence[ConfiguredExporter]) -> None:
    """Let each sink with a ``close()`` (plain or async) release what it holds (connections, files).

    A sink that fails to close is logged and the others are still closed.
    """
    for configured in exporters:
        close = getattr(configured.sink, "close", None)
        if not callable(close):
            continue
        try:
            result = close()
            if inspect.isawaitable(result):
                await result
        except (Exception, SystemExit):  # sys.exit() in a sink's close must not end the command as it pleases
            _logger.warning(
                "Closing exporter %r (consumer %r) failed.", configured.use, configured.consumer, exc_info=True
            )


def _record(
    output: Output, kind: str, configured: ConfiguredExporter, head: str, tail: str = "", **fields: Any
) -> None:
    """One lifecycle line about an exporter: ``head``, its name and consumer, then ``tail``."""
    line = f"{head} exporter={configured.use} consumer={configured.consumer}{tail}"
    output.record(kind, line, exporter=configured.use, consumer=configured.consumer, **fields)


async def export_pending(
    runtime: Any, output: Output, configured: ConfiguredExporter, *, stopping: asyncio.Event | None = None
) -> None:
    """Export batches until none is pending (or ``stopping`` is set, between two batches), then one
    lifecycle line reports the count."""
    exporter = runtime.observation_exporter(configured.consumer, configured.sink)
    exported = 0
    while stopping is None or not stopping.is_set():
        tick = await exporter.export_once()
        if tick.status is RunlaneObservationExporterTickStatus.FAILED:
            error = tick.error
            if isinstance(error, RunlaneError):
                raise error
            raise RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"Exporter {configured.use!r} (consumer {configured.consumer!r}) failed: {error!r}.",
            ) from error
        exported += tick.exported
        if tick.status is not RunlaneObservationExporterTickStatus.EXPORTED:
            break
    _record(output, "exported", configured, f"exported {exported} observation(s)", exported=exported)


def start_exporter(
    output: Output, configured: ConfiguredExporter, exporter: Any, controller: CancellationController
) -> asyncio.Future[RunlaneError | None]:
    """One exporter loop, stopped by aborting ``controller``'s signal. A failure it cannot retry (an
    endpoint that refuses the records for good, say) stops this loop alone: it is reported as an
    ``exporter_failed`` record and returned, and whatever runs beside it (other exporters, the worker
    of ``runlane dev``) goes on. Telemetry never stops the work it observes."""
    _record(output, "exporter_started", configured, "exporter started")

    async def loop() -> RunlaneError | None:
        try:
            await exporter.run(signal=controller.signal)
        except RunlaneError as error:
            tail = f" ({error.code.value}): {error.message} It has stopped; fix it and restart the command."
            _record(output, "exporter_failed", configured, "exporter failed", tail, error_code=error.code.value)
            return error
        finally:
            exported = exporter.stats.exported
            tail = f" exported={exported}"
            _record(output, "exporter_stopped", configured, "exporter stopped", tail, exported=exported)
        return None

    return asyncio.ensure_future(loop())


async def stop_exporters(tasks: Sequence[asyncio.Future[RunlaneError | None]]) -> None:
    """Wait for every exporter loop (their signal is already aborted); the first failure (of one that
    stopped on its own, or raised) is raised, so the command ends with status 1."""
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result
        if isinstance(result, RunlaneError):
            raise result
