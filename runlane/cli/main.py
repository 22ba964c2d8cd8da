"""The ``runlane`` command: global options, the command groups composed into one app, and runtime access.

This module owns the root ``typer.Typer`` app, the global ``-c/--config``, ``--json`` and ``--version``
options, ``open_runtime()`` (the single way a command gets a started runtime, so a control bridge to a
live ``runlane dev`` can be routed through it later), the ``RunlaneError`` -> exit status 1 mapping,
and plugin command registration. Commands live one group per module; rendering lives in ``output``.
"""

from __future__ import annotations

import asyncio
import atexit
import codecs
import contextlib
import errno
import functools
import inspect
import json
import os
import signal
import stat
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import BaseModel, ConfigDict, ValidationError
from typer.core import TyperGroup

from .. import __version__
from ..config import LoadedConfig, build_runtime, load_config
from ..core.runtime import Runlane
from ..errors import ErrorCode, RunlaneError, describe_exception
from ..plugins.manager import get_registries, is_first_party, load_plugins, loading_plugins, pm, skip_plugin
from ..plugins.registries import LaneProvider, ProviderContext, Registries, first_party_hint, validate_options
from .output import LineStream, Output, forward_runtime_logs, json_import_logs, quiet_connection_pool

__all__ = [
    "OPERATIONS",
    "CliState",
    "ConfiguredExporter",
    "Operation",
    "OperationParams",
    "app",
    "build_app",
    "configured_exporters",
    "invoke",
    "build_configured_runtime",
    "open_runtime",
    "operation",
    "require_shared_lane",
    "run",
    "run_operation",
    "state_of",
    "usage_error",
    "usage_guard",
    "with_runtime",
]

T = TypeVar("T")


@dataclass(slots=True)
class CliState:
    """What the global options decided for this invocation."""

    config_path: Path | None = None
    output: Output = field(default_factory=Output)
    lane_provider: LaneProvider | None = None  # the provider of the configured lane, once it is built


def state_of(ctx: typer.Context) -> CliState:
    state = ctx.find_root().obj
    if not isinstance(state, CliState):  # a command invoked without the root callback (plugin tests)
        state = CliState()
        ctx.find_root().obj = state
    return state


def load_cli_config(ctx: typer.Context) -> LoadedConfig:
    """The configuration named by ``-c/--config`` or found in the working directory.

    Its ``[[exporters]]`` entries are checked too (provider names and options, no sink is built), so a
    mistake there fails every command that loads the config, not only the ones that export.
    """
    state = state_of(ctx)
    config = load_config(state.config_path)
    if config is None:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"No runlane.toml (or [tool.runlane] in pyproject.toml) in {Path.cwd()}; "
            "run `runlane init config` or pass -c/--config PATH.",
        )
    _exporter_options(config, get_registries())
    return config


def _lane_factory(
    config: LoadedConfig, registries: Registries, state: CliState | None = None
) -> Callable[[str, dict[str, Any]], Any]:
    """Builds the configured lane through its provider (remembered in ``state``, for ``open_runtime``)."""

    def create(use: str, options: dict[str, Any]) -> Any:
        with in_config_file(config):
            provider = registries.lanes.get(use)
            validated = validate_options(provider, options, table=f"[{config.source.table_name('lane')}]")
        if state is not None:
            state.lane_provider = provider
        context = ProviderContext(environment=config.environment, base_dir=config.base_dir, registries=registries)
        # What the provider refuses when it builds the lane (a schema name, an SQLite path) is about the
        # file's [lane] table too.
        with in_config_file(config):
            created = _created(provider, lambda: provider.create(validated, context), _is_lane, "a Lane")
        if not inspect.isawaitable(created):
            return created

        async def named() -> Any:
            with in_config_file(config):
                return await created

        return named()

    return create


def _is_lane(value: Any) -> bool:
    from ..core.lanes import Lane

    return isinstance(value, Lane)


def _is_sink(value: Any) -> bool:
    return callable(getattr(value, "export", None))


def _created(provider: Any, create: Callable[[], Any], valid: Callable[[Any], bool], expected: str) -> Any:
    """``create()``, a provider's ``create`` (its result awaited when it is awaitable): a plain exception
    from the plugin's code, ``sys.exit()`` in it, or a result that is not ``expected``, becomes a
    ``configuration_invalid`` naming the provider and its plugin, not a traceback or a silent exit."""
    try:
        created = create()
    except RunlaneError:
        raise
    except (Exception, SystemExit) as error:
        raise _provider_failed(provider, describe_exception(error), error) from error
    if inspect.isawaitable(created):

        async def checked() -> Any:
            try:
                value = await created
            except RunlaneError:
                raise
            except (Exception, SystemExit) as error:
                raise _provider_failed(provider, describe_exception(error), error) from error
            return _valid_creation(provider, value, valid, expected)

        return checked()
    return _valid_creation(provider, created, valid, expected)


def _valid_creation(provider: Any, value: Any, valid: Callable[[Any], bool], expected: str) -> Any:
    if not valid(value):
        raise _provider_failed(provider, f"its create() returned {type(value).__name__}, not {expected}", None)
    return value


def _provider_failed(provider: Any, why: str, error: BaseException | None) -> RunlaneError:
    return RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"The {provider.kind} {provider.name!r} of plugin {provider.plugin!r} failed to start: {why}. "
        "Check its options, or report it to the plugin's authors.",
        meta={"provider": provider.name, "plugin": provider.plugin},
        cause=error,
    )


@dataclass(frozen=True, slots=True)
class ConfiguredExporter:
    """One ``[[exporters]]`` entry resolved to its provider's sink, ready for ``runtime.observation_exporter``."""

    use: str
    consumer: str
    sink: Any


def configured_exporters(config: LoadedConfig, registries: Registries | None = None) -> list[ConfiguredExporter]:
    """Every ``[[exporters]]`` entry's sink, built by the named exporter provider from its validated options.

    An unknown provider name or an invalid option is ``configuration_invalid`` (naming the installed
    exporters or the offending key) before any sink is created.
    """
    registries = registries if registries is not None else get_registries()
    resolved = _exporter_options(config, registries)
    context = ProviderContext(environment=config.environment, base_dir=config.base_dir, registries=registries)
    return [
        ConfiguredExporter(
            entry.use,
            entry.consumer,
            _created(provider, lambda: provider.create(options, context), _is_sink, "a sink with export(records)"),
        )
        for entry, provider, options in resolved
    ]


def _exporter_options(config: LoadedConfig, registries: Registries) -> list[tuple[Any, Any, BaseModel]]:
    """Each ``[[exporters]]`` entry with its provider and validated options; nothing is created."""
    table = config.source.table_name("exporters")
    resolved = []
    for index, entry in enumerate(config.exporters):
        with in_config_file(config):
            provider = registries.exporters.get(entry.use)
            options = validate_options(provider, entry.options, table=f"[[{table}]] #{index + 1}")
        resolved.append((entry, provider, options))
    return resolved


@contextlib.contextmanager
def in_config_file(config: LoadedConfig) -> Iterator[None]:
    """A plugin's verdict on a table of ``config`` (an unknown ``use``, options its model refuses) names the
    file first, as every error about the file's own tables does."""
    try:
        yield
    except RunlaneError as error:
        source = config.source
        if not source.display or error.message.startswith(f"{source.display}: "):
            raise
        raise RunlaneError(
            error.code,
            f"{source.display}: {error.message}",
            retryable=error.retryable,
            meta={**error.meta, "path": str(source.path)},
            cause=error,
        ) from None


async def build_configured_runtime(ctx: typer.Context) -> Runlane:
    """The configured runtime, built and not started: its lane is created but connects nowhere yet."""
    config = load_cli_config(ctx)
    registries = get_registries()
    with json_import_logs(state_of(ctx).output):  # the task modules are imported here
        return await build_runtime(
            config,
            lane_factory=_lane_factory(config, registries, state_of(ctx)),
            task_modules={contribution.value: contribution.plugin for contribution in registries.task_modules},
            observers=registries.plugin_observers(),
        )


@asynccontextmanager
async def open_runtime(ctx: typer.Context, *, wait_for_storage: bool = False) -> AsyncIterator[Runlane]:
    """A started runtime for the configured lane, closed when the block ends.

    Every runtime-backed command goes through here; when a process-local lane has a live ``runlane dev``
    session, this is where the command will be proxied instead of building a fresh (empty) runtime.
    With ``wait_for_storage`` (the long-running commands) a lane that cannot start for a retryable
    reason, a database that is not up yet, is retried until it starts or the process is told to stop.
    """
    runtime = await build_configured_runtime(ctx)
    output = state_of(ctx).output
    # A connection the database dropped while the command ran (a server restarting under runlane runs
    # wait) is reported by the command's own error, not by a bare line from the pool as well. What the
    # runtime logs while it starts (a clock that is off the database server's), runs the command (an
    # observer that raised) and closes is printed as the command's later records are (with --json, as
    # JSON), not by Python's last-resort handler.
    with quiet_connection_pool(), forward_runtime_logs(output):
        try:
            try:
                if wait_for_storage:
                    await _start_when_storage_answers(runtime, output)
                else:
                    await runtime.start()
            except (RunlaneError, typer.Exit):  # typer.Exit: stopped while waiting for storage, not a failure
                raise
            except (Exception, SystemExit) as error:
                # A third-party lane's own failure (sys.exit() in it too, which would end the command as if it
                # had run) names the lane and its plugin, as one in its create() does; one of runlane's lanes
                # keeps its traceback (runlane's bug to report).
                provider = state_of(ctx).lane_provider
                if provider is None or is_first_party(provider.plugin):
                    raise
                raise _provider_failed(provider, describe_exception(error), error) from error
            try:
                yield runtime
            except (RunlaneError, typer.Exit):
                raise
            except Exception as error:
                # What a third-party lane's own code raised while the command ran (its storage driver's
                # outage or bug) names the lane and its plugin; anything else keeps its traceback.
                provider = state_of(ctx).lane_provider
                if provider is None or is_first_party(provider.plugin) or not _raised_by(error, runtime.lane):
                    raise
                raise _lane_failed(provider, error) from error
        finally:
            await runtime.close()


def _raised_by(error: BaseException, lane: Any) -> bool:
    """Whether a frame of ``error``'s traceback is code of the package of ``lane``'s storage driver or transport,
    when that is not one of runlane's own (a third-party lane may compose runlane-local's driver)."""
    from ..plugins.manager import FIRST_PARTY_PACKAGES

    packages = {
        type(adapter).__module__.partition(".")[0]
        for adapter in (lane.storage, lane.delivery.transport)
        if adapter is not None
    } - FIRST_PARTY_PACKAGES
    return any(
        str(frame.f_globals.get("__name__", "")).partition(".")[0] in packages
        for frame, _ in traceback.walk_tb(error.__traceback__)
    )


def _lane_failed(provider: Any, error: BaseException) -> RunlaneError:
    return RunlaneError(
        ErrorCode.INTERNAL_ERROR,
        f"The {provider.kind} {provider.name!r} of plugin {provider.plugin!r} failed: {describe_exception(error)}. "
        "Report it to the plugin's authors (a storage outage should be a retryable storage_unavailable error), "
        "or leave the plugin out with RUNLANE_LOAD_PLUGINS.",
        meta={"provider": provider.name, "plugin": provider.plugin, "exception": type(error).__name__},
        cause=error,
    )


_FIRST_RETRY_S = 0.5
_MAX_RETRY_S = 10.0


async def _start_when_storage_answers(runtime: Runlane, output: Output) -> None:
    """``runtime.start()``, retried with backoff while it fails retryably; a SIGINT/SIGTERM meanwhile
    ends the command with status 0, as it would once started. A non-retryable failure raises at once."""
    try:
        await runtime.start()
        return
    except RunlaneError as error:
        if not error.retryable:
            raise
        first = error
    stop = asyncio.Event()
    delay = _FIRST_RETRY_S
    attempt: asyncio.Future[None] | None = None

    received: list[tuple[signal.Signals, float]] = []

    def on_signal(signum: signal.Signals) -> None:
        if stop.is_set():
            if received and repeated_delivery(received[0], signum):
                return
            exit_now(output, signum)  # a second signal: at once
        received.append((signum, time.monotonic()))
        stop.set()
        if attempt is not None:
            attempt.cancel()  # a connection attempt may take its whole timeout: do not wait for it

    with on_stop_signals(on_signal):
        # Said once the signals are ours, so whoever reads it may stop us at once.
        output.record(
            "storage_waiting",
            f"waiting for storage: {first.message} Retrying until it answers (Ctrl-C to give up).",
            error=first.to_json(),
        )
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            if not stop.is_set():
                delay = min(delay * 2, _MAX_RETRY_S)
                attempt = asyncio.ensure_future(runtime.start())
                try:
                    await attempt
                    break
                except asyncio.CancelledError:
                    if not stop.is_set():
                        raise
                except RunlaneError as error:
                    if not error.retryable:
                        raise
                finally:
                    attempt = None
            if stop.is_set():
                break
    if stop.is_set():
        after_stop_signal(output, received[0])
        output.record("stopped", "stopped before storage answered")
        raise typer.Exit(0)
    output.record("storage_available", "storage answered; starting")


def exit_now(output: Output, signum: signal.Signals) -> NoReturn:
    """A second SIGINT/SIGTERM: run the quick clean-ups (``on_forced_exit``) and exit at once."""
    name = signal.Signals(signum).name
    output.record("exit", f"received {name} again; exiting now", signal=name)
    for clean_up in list(FORCED_EXIT_CLEANUPS):
        with contextlib.suppress(Exception):
            clean_up()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + int(signum))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# A second signal this soon after the first, of the same kind, is the same stop delivered twice, not a
# person asking again: coreutils `timeout` (and a process manager signalling the process and then its
# group) sends SIGTERM to the process and to its group at once.
SIGNAL_REPEAT_S = 0.25


def repeated_delivery(first: tuple[signal.Signals, float], signum: signal.Signals) -> bool:
    """Whether ``signum`` repeats ``first`` (the first stop signal and its ``time.monotonic()``) at once."""
    return signum == first[0] and time.monotonic() - first[1] < SIGNAL_REPEAT_S


def after_stop_signal(output: Output, first: tuple[signal.Signals, float]) -> None:
    """Once a command stopping on ``first`` has given back the event loop's handlers, and for the rest of
    its shutdown: the same signal delivered again at once is still ignored (else the default action, a
    ``KeyboardInterrupt`` or a kill, would end a clean stop with 130 or 143), and any other stop signal
    exits at once, as a second one does while the loop handles them."""

    def on_signal(signum: int, _frame: object) -> None:
        if not repeated_delivery(first, signal.Signals(signum)):
            exit_now(output, signal.Signals(signum))

    for signum in STOP_SIGNALS:
        with contextlib.suppress(ValueError):  # not the main thread: the loop never had them either
            signal.signal(signum, on_signal)
    # The interpreter's exit gives handlers such as this one back to the default action before it ends,
    # but leaves ignored signals ignored: a repeat then must not kill the process with that signal.
    atexit.register(_ignore_stop_signals)


def _ignore_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        with contextlib.suppress(ValueError):
            signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[signal.Signals], object]) -> Iterator[None]:
    """Call ``handler(signum)`` on the running loop for SIGINT/SIGTERM while the block runs, where the
    loop can take signals (the main thread, on a platform with them); the previous handling after."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for signum in STOP_SIGNALS:
        try:
            loop.add_signal_handler(signum, handler, signum)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals: nothing to stop us
            continue
        installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


def invoke(ctx: typer.Context, main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main`` on a fresh event loop; a ``RunlaneError`` is printed with its code and exits 1."""
    state = state_of(ctx)
    try:
        return asyncio.run(main())  # type: ignore[arg-type]
    except RunlaneError as error:
        state.output.error(error)
        raise typer.Exit(1) from None


def with_runtime(
    ctx: typer.Context,
    body: Callable[[Runlane], Awaitable[T]],
    *,
    wait_for_storage: bool = False,
    health_file: Path | None = None,
) -> T:
    """``invoke`` a body that needs a started runtime (see ``open_runtime`` for ``wait_for_storage``),
    touching ``health_file`` while the body runs (see ``touching``)."""

    async def main() -> T:
        if health_file is not None:
            # One a killed process left must not pass a probe while this one waits for storage.
            if not _remove_health_file(health_file):
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID,
                    f"The health file {health_file} already exists and is not an empty file, so it is not one "
                    "a Runlane process left; name a path of its own.",
                    meta={"path": str(health_file)},
                )
        async with open_runtime(ctx, wait_for_storage=wait_for_storage) as runtime, touching(health_file):
            plugin = _plugin_command_owners.get(ctx.find_root().invoked_subcommand or "")
            if plugin is not None and not is_first_party(plugin) and runtime.lane.capabilities.process_local:
                # runlane's own commands (its plugins' too) say what a process-local lane means for each of
                # them; another plugin's would report an empty store as if it were the lane's state.
                state_of(ctx).output.warning(
                    "process_local_lane", _plugin_command_alone(runtime, ctx.find_root().invoked_subcommand, plugin)
                )
            return await body(runtime)

    return invoke(ctx, main)


def _plugin_command_alone(runtime: Runlane, command: str | None, plugin: str) -> str:
    return (
        f"the {runtime.lane.name!r} lane keeps runs in one process, so command {command!r} of plugin {plugin!r} "
        "runs on an empty lane of its own that is gone when it exits, and does not reach the runs of a "
        "`runlane dev`; use the sqlite lane to share runs between processes."
    )


HEALTH_FILE_INTERVAL_S = 2.0

# Quick, synchronous clean-ups an immediate exit (a second Ctrl-C / SIGTERM) still runs.
FORCED_EXIT_CLEANUPS: list[Callable[[], None]] = []


@contextlib.contextmanager
def on_forced_exit(cleanup: Callable[[], None]) -> Iterator[None]:
    """Run ``cleanup`` at an immediate exit while the block runs (it is the block's own job otherwise)."""
    FORCED_EXIT_CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        FORCED_EXIT_CLEANUPS.remove(cleanup)


@asynccontextmanager
async def touching(path: Path | None) -> AsyncIterator[None]:
    """Touch ``path`` now and every ``HEALTH_FILE_INTERVAL_S`` until the block ends, then remove it.

    For liveness and readiness probes: the file appears once the runtime has started (storage
    answered), and it stays fresh only while this process's event loop runs, so a process whose loop
    is blocked or wedged lets it go stale. A file that cannot be written at the start is
    ``configuration_invalid``; a later failure to touch it only lets it go stale.
    """
    if path is None:
        yield
        return
    try:
        _touch(path)
    except OSError as error:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Cannot write the health file {path}: {error.strerror or error}. Pick a writable path.",
            meta={"path": str(path)},
        ) from None

    async def keep_touching() -> None:
        while True:
            await asyncio.sleep(HEALTH_FILE_INTERVAL_S)
            with contextlib.suppress(OSError):
                _touch(path)

    def remove() -> None:
        _remove_health_file(path)

    toucher = asyncio.ensure_future(keep_touching())
    try:
        with on_forced_exit(remove):
            yield
    finally:
        toucher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await toucher
        remove()


def _remove_health_file(path: Path) -> bool:
    """Remove ``path`` if it is what a health file is, an empty regular file; ``False`` when something else
    is there (a mistyped path must not delete a database or a source file)."""
    try:
        info = path.lstat()
    except OSError:
        return True  # nothing there
    if not stat.S_ISREG(info.st_mode) or info.st_size:
        return False
    with contextlib.suppress(OSError):
        path.unlink()
    return True


def _touch(path: Path) -> None:
    """Create ``path`` or update its time, never through a symbolic link (one planted by another user who
    can write its folder would have this process create or touch a file of their choosing) and never
    waiting on a FIFO."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(error.errno, "it is a symbolic link; name the file itself") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file")
        os.utime(descriptor)
    finally:
        os.close(descriptor)


class OperationParams(BaseModel):
    """The arguments of one stateful command, as plain JSON values: what crosses the dev bridge."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class Operation:
    """A stateful command's runtime call and its rendering, shared by local runs and the dev bridge.

    ``call`` gets a started runtime and the validated params and calls the public runtime API; ``render``
    hands the result to the output layer. A local command runs both in this process; a command proxied
    into ``runlane dev`` runs both there, with an ``Output`` that renders for the calling terminal.
    ``summary`` is the result in a few words (``✓ created run_123``), for the ``command`` line a
    ``runlane dev`` process prints for each command it runs for another terminal. ``exit_status`` is the
    status a result exits with (0 unless the command documents others); ``answer_within``, for a command
    that may take long, how long it may take to answer when proxied into ``runlane dev``, in seconds, from
    its params (``None``: as long as it takes); without it the bridge's own limit applies. ``creates_runs``
    marks a command that creates runs, which a stopping ``runlane dev`` refuses: they would end with it, unrun.
    """

    name: str
    params: type[OperationParams]
    call: Callable[[Runlane, Any], Awaitable[Any]]
    render: Callable[[Output, Any, Any], None]
    summary: Callable[[Any, Any], str]
    exit_status: Callable[[Any, Any], int] = lambda params, result: 0
    answer_within: Callable[[Any], float | None] | None = None
    creates_runs: bool = False


OPERATIONS: dict[str, Operation] = {}
"""The stateful commands by name; the dev bridge serves exactly these."""


def operation(
    name: str,
    params: type[OperationParams],
    render: Callable[[Output, Any, Any], None],
    *,
    summary: Callable[[Any, Any], str],
    exit_status: Callable[[Any, Any], int] | None = None,
    answer_within: Callable[[Any], float | None] | None = None,
    creates_runs: bool = False,
) -> Callable[[Callable[[Runlane, Any], Awaitable[Any]]], Callable[[Runlane, Any], Awaitable[Any]]]:
    """Register ``call`` as the stateful command ``name`` (see ``Operation`` for the other arguments)."""

    def register(call: Callable[[Runlane, Any], Awaitable[Any]]) -> Callable[[Runlane, Any], Awaitable[Any]]:
        op = Operation(
            name=name,
            params=params,
            call=call,
            render=render,
            summary=summary,
            answer_within=answer_within,
            creates_runs=creates_runs,
        )
        OPERATIONS[name] = op if exit_status is None else replace(op, exit_status=exit_status)
        return call

    return register


def parse_params(op: Operation, values: Any) -> OperationParams:
    """``values`` validated against the command's params; anything else is ``configuration_invalid``."""
    try:
        return op.params.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "params"
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID, f"Invalid {op.name} arguments: {where}: {first.get('msg')}."
        ) from None


def run_operation(ctx: typer.Context, name: str, **values: Any) -> None:
    """Run the stateful command ``name``: proxied into a live ``runlane dev`` session for this config
    path when there is one (a process-local lane's state lives there), otherwise on a runtime loaded here."""
    run_operations(ctx, name, [values])


def run_operations(ctx: typer.Context, name: str, items: list[dict[str, Any]]) -> None:
    """``run_operation`` for each of ``items`` in turn (``runlane cancel A B C``), on one runtime or through
    one ``runlane dev`` session: each result, or error, is printed as it comes (one JSON document per line
    with ``--json``), and one item's error does not stop the others. Exits with the first non-zero status
    a result has (``Operation.exit_status``), or 1 when an item failed."""
    if not items:
        return  # ``-`` read no run ids: nothing to run (the caller said so)
    state = state_of(ctx)
    output = state.output
    op = OPERATIONS[name]
    params_list = [guard(ctx, functools.partial(parse_params, op, values)) for values in items]
    several = len(params_list) > 1

    async def main() -> int:
        from .bridge import lane_signature, proxy

        config = load_cli_config(ctx)
        statuses: list[int] = []

        def failed(error: RunlaneError) -> None:
            if not several:
                raise error  # printed by ``invoke``, as any command's error
            output.error(error)
            statuses.append(1)

        proxied: bool | None = None  # unknown until the first item
        runtime: Runlane | None = None
        async with contextlib.AsyncExitStack() as stack:
            for params in params_list:
                if proxied is not False:
                    try:
                        status = await proxy(config.path, op, params, output, lane=lane_signature(config))
                    except RunlaneError as error:
                        proxied = True
                        failed(error)
                        continue
                    if status is not None:
                        proxied = True
                        statuses.append(status)
                        continue
                    if proxied:
                        failed(RunlaneError(ErrorCode.TRANSPORT_UNAVAILABLE, "The runlane dev process went away."))
                        continue
                    proxied = False
                if runtime is None:
                    runtime = await stack.enter_async_context(open_runtime(ctx))
                    if runtime.lane.capabilities.process_local:
                        output.warning("process_local_lane", _alone_on_a_process_local_lane(runtime, config))
                try:
                    result = await op.call(runtime, params)
                except RunlaneError as error:
                    failed(error)
                    continue
                op.render(output, params, result)
                statuses.append(op.exit_status(params, result))
        return next((status for status in statuses if status), 0)

    status = invoke(ctx, main)
    if status:
        raise typer.Exit(status)


def _alone_on_a_process_local_lane(runtime: Runlane, config: LoadedConfig) -> str:
    return (
        f"the {runtime.lane.name!r} lane keeps runs in this process only and no `runlane dev` serves "
        f"{config.path.name} as it reads now: this command ran on an empty lane that is gone when it exits. "
        "Start `runlane dev` in another terminal so commands share its state, or use the sqlite lane."
    )


def require_shared_lane(runtime: Runlane, *, separately: str, dev_does: str, command: str) -> None:
    """Refuse a process-local lane for a long-running command other than ``runlane dev``: in a process
    of its own it would only see an empty store."""
    lane = runtime.lane
    if lane.capabilities.process_local:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The {lane.name!r} lane keeps its state in one process, so {separately}; `runlane dev` {dev_does}. "
            f"Use {command} with a shared lane (sqlite, postgres-polling, postgres-sqs).",
        )


def guard(ctx: typer.Context, check: Callable[[], T]) -> T:
    """Run a check of the configuration before any runtime exists; its ``RunlaneError`` exits 1 like any other."""
    try:
        return check()
    except RunlaneError as error:
        state_of(ctx).output.error(error)
        raise typer.Exit(1) from None


def usage_guard(ctx: typer.Context, check: Callable[[], T]) -> T:
    """Run a check of the command line alone (options that do not go together); its ``RunlaneError`` is a
    usage error (exit 2), reported by Click like an unknown option. A malformed value of one option is
    checked by its callback instead (``options.checked``), so Click names the option."""
    try:
        return check()
    except RunlaneError as error:
        ctx.fail(error.message)


def usage_error(message: str) -> RunlaneError:
    """A problem of the command line for ``usage_guard`` to report."""
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message)


def _config_path(text: str) -> Path:
    """``-c``'s value: a file's path (it need not exist yet: ``runlane -c PATH init config`` writes it)."""
    if not text.strip():
        raise typer.BadParameter("the path is empty; give the path of a runlane.toml, or leave -c out")
    path = Path(text)
    if path.is_dir():
        in_it = path / "runlane.toml"
        raise typer.BadParameter(f"{text!r} is a directory; give the path of a config file in it ({in_it})")
    return path


def _version(value: bool) -> None:
    if value:
        typer.echo(f"runlane {__version__}")
        raise typer.Exit(0)


def _root(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("-c", "--config", help="Config file (default: ./runlane.toml or [tool.runlane] in pyproject.toml).",
                     metavar="PATH", parser=_config_path),
    ] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Results and Runlane errors as JSON (long-running output as NDJSON); also accepted after the command.",
        ),
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Durable tasks on your own infrastructure."""
    ctx.obj = CliState(config_path=config, output=Output(json_mode=json_output))


COMMAND_LINE = "runlane.command_line"

EXIT_STATUS = (
    "Exit status: 0 success; 1 a Runlane error, printed with its code (error[run_not_found]: ..., or "
    "{\"error\": ...} with --json); 2 a usage error: an unknown command or option, a missing or malformed "
    "value (a date, duration or JSON the command line reads), or options that do not go together, "
    "printed as text by the command line parser (also with --json); 3 and 4 from runlane runs wait: the "
    "run failed or was cancelled, or it had not finished at --timeout; 141 the reader of stdout stopped "
    "reading (runlane runs list | head -1), as for other Unix tools; 130 or 143 a SIGINT or SIGTERM "
    "ended the command before it finished (a drain, work --drain or dev --once, exits so once its current "
    "runs are done); a worker meant to run until stopped exits 0 on that signal."
)


class _RootGroup(TyperGroup):
    """The root command; ``--json`` also works after the command (``runlane runs list --json``).

    Global options belong before the command, but ``--json`` is a flag no command defines, so
    wherever it appears before ``--`` it can only mean the global option, and it is moved there.
    """

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        ctx.meta[COMMAND_LINE] = list(args)  # as given, for a command that restarts itself (dev --reload)
        end = args.index("--") if "--" in args else len(args)
        if "--json" in args[1:end]:
            args = ["--json", *[arg for arg in args[:end] if arg != "--json"], *args[end:]]
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> Any:  # type: ignore[override]
        # A command of runlane's own plugins (`runlane postgres`) where that plugin is not installed or
        # did not load: say which distribution brings it, not only that there is no such command.
        if args and not ctx.resilient_parsing and self.get_command(ctx, args[0]) is None:
            hint = first_party_hint("command", args[0])
            if hint:
                ctx.fail(f"No such command {args[0]!r}.{hint}")
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except typer.BadParameter as error:
            # Typer words a value its annotation refuses the way pydantic does ("Value error, ...").
            error.message = error.message.removeprefix("Value error, ")
            raise
        except RunlaneError as error:  # from a command that does not use ``invoke`` (a plugin's)
            state_of(ctx).output.error(error)
            raise typer.Exit(1) from None
        except Exception as error:
            from .output import OutputLost

            plugin = _plugin_command_owners.get(ctx.invoked_subcommand or "")
            # How the command line ends (an exit, a usage error, a closed stdout) is not a failure of the
            # plugin, and runlane's own commands keep their traceback: it is runlane's bug to report.
            if (
                plugin is None
                or isinstance(error, (typer.Exit, typer.Abort, typer.TyperException, EOFError, OutputLost))
                or (isinstance(error, OSError) and error.errno == errno.EPIPE)
            ):
                raise
            state_of(ctx).output.error(
                RunlaneError(
                    ErrorCode.INTERNAL_ERROR,
                    f"command {ctx.invoked_subcommand!r} of plugin {plugin!r} failed: {describe_exception(error)}. "
                    "Report it to the plugin's authors, or leave the plugin out with RUNLANE_LOAD_PLUGINS.",
                    meta={"command": ctx.invoked_subcommand, "plugin": plugin, "exception": type(error).__name__},
                    cause=error,
                )
            )
            raise typer.Exit(1) from None


def build_app() -> typer.Typer:
    """The root app with every built-in command group and every plugin's commands."""
    from . import (
        actions,
        dev,
        export,
        init,
        observations,
        plugins,
        queues,
        runs,
        schedules,
        signal,
        tick,
        trigger,
        tui,
        work,
    )

    root = typer.Typer(
        cls=_RootGroup,
        name="runlane",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
        epilog=EXIT_STATUS,
    )
    root.callback()(_root)
    root.add_typer(init.app, name="init")
    root.add_typer(runs.app, name="runs")
    root.add_typer(signal.app, name="signal")
    root.add_typer(observations.app, name="observations")
    root.add_typer(plugins.app, name="plugins")
    # Single-command groups merge into the root: `runlane trigger`, not `runlane trigger trigger`.
    for module in (dev, work, tick, export, trigger, actions, queues, schedules, tui):
        root.add_typer(module.app)
    load_plugins()
    get_registries()  # a plugin whose registration fails is skipped here, so it adds no command below
    _register_plugin_commands(root)
    return root


def command_names(commands: Sequence[Any], groups: Sequence[Any]) -> list[str]:
    """The top-level names of Typer's registered ``commands`` and ``groups`` (a group added without a
    name contributes its own commands)."""
    names = []
    for command in commands:
        name = command.name if isinstance(command.name, str) else None
        names.append(name or command.callback.__name__.lower().replace("_", "-"))  # Typer's default
    for group in groups:
        name = _group_name(group)
        sub = group.typer_instance
        names.extend([name] if name else command_names(sub.registered_commands, sub.registered_groups))
    return names


def _group_name(group: Any) -> str | None:
    """The name a registered Typer group is added under: its own, or its sub-app's; ``None`` for none."""
    if isinstance(group.name, str) and group.name:
        return group.name
    name = group.typer_instance.info.name
    return name if isinstance(name, str) and name else None


# Top-level command name -> the plugin that added it, so a failing plugin command is reported naming it.
_plugin_command_owners: dict[str, str] = {}


def _register_plugin_commands(root: typer.Typer) -> None:
    """Each plugin's ``register_commands``, one at a time; the CLI itself always starts.

    A plugin whose hook raises, whose commands Typer cannot build (an annotation that does not
    resolve, a Click object) or that adds a runlane command's name is skipped (reported like a plugin
    that fails to import) and what it added is taken back. A name two plugins add is added by
    neither, as for providers: both plugins stay, and each is reported.
    """
    builtin = set(command_names(root.registered_commands, root.registered_groups))
    added_by: dict[str, list[str]] = {}  # command name -> the plugins that added it
    entries: list[tuple[list[Any], list[Any]]] = []  # per plugin: its commands and groups
    for hook in reversed(pm.hook.register_commands.get_hookimpls()):  # pluggy calls the last registered first
        commands, groups = len(root.registered_commands), len(root.registered_groups)
        callback = root.registered_callback
        try:
            hook.function(*(root for _ in hook.argnames))  # an implementation may take fewer arguments (none)
            new_commands, new_groups = root.registered_commands[commands:], root.registered_groups[groups:]
            problem = _not_typer(new_commands, new_groups)
            added = [] if problem else command_names(new_commands, new_groups)
            clashes = sorted(set(added) & builtin)
            if clashes:
                problem = (
                    f"its command {clashes[0]!r} is already a runlane command"
                    if len(clashes) == 1
                    else f"its commands {', '.join(map(repr, clashes))} are already runlane commands"
                )
            if root.registered_callback is not callback:
                # @app.callback() on the root replaces runlane's own, and with it -c, --json and --version
                # for every command.
                problem = (
                    "its register_commands set the callback of the runlane command itself (app.callback()); "
                    "give a sub-app of its own the callback and add that with app.add_typer(...)"
                )
        except (Exception, SystemExit) as error:  # a broken plugin must never take the CLI down
            problem = f"register_commands raised {describe_exception(error)}"
        root.registered_callback = callback
        if problem is None:
            try:
                _build(new_commands, new_groups)
            except (Exception, SystemExit) as error:
                problem = f"its commands cannot be built ({describe_exception(error)})"
        if problem is not None:
            del root.registered_commands[commands:], root.registered_groups[groups:]
            skip_plugin(hook.plugin_name, f"{problem}; the plugin is left out whole, its lanes and other hooks too.")
            continue
        for name in dict.fromkeys(added):
            added_by.setdefault(name, []).append(hook.plugin_name)
        entries.append((new_commands, new_groups))
    shared = {name: plugins for name, plugins in added_by.items() if len(plugins) > 1}
    for name, plugins in shared.items():
        owners = " and ".join(repr(plugin) for plugin in sorted(plugins))
        print(
            f"runlane: the command {name!r} is added by plugins {owners}; it is added by neither "
            "(uninstall one of them or limit plugins with RUNLANE_LOAD_PLUGINS).",
            file=sys.stderr,
        )
    for plugin_commands, plugin_groups in entries if shared else ():
        _drop_names(root.registered_commands, plugin_commands, root.registered_groups, plugin_groups, shared.keys())
    _plugin_command_owners.update({name: plugins[0] for name, plugins in added_by.items() if name not in shared})


def _not_typer(commands: Sequence[Any], groups: Sequence[Any]) -> str | None:
    """What is wrong with a Click object given to ``app.command()(...)`` or a sub-app of ``app.add_typer(...)``
    that is not a Typer (Typer stores both without complaint, then fails to build them with an error that
    does not say why), or ``None``.

    A Click command is told by what it does, not by its class: the plugin may have built it with Click
    itself or with the copy of Click that Typer carries, and Click need not be installed at all."""

    def named(value: object) -> str:
        return f"{type(value).__module__}.{type(value).__qualname__}"

    def click_command(value: object) -> bool:
        return callable(getattr(value, "make_context", None)) and callable(getattr(value, "invoke", None))

    for command in commands:
        if click_command(command.callback):
            return (
                f"its register_commands passed {named(command.callback)} to app.command(), which takes a "
                "function (never a Click object)"
            )
    for group in groups:
        if not isinstance(group.typer_instance, typer.Typer):
            return (
                f"its register_commands passed {named(group.typer_instance)} to app.add_typer(...), which takes "
                "a typer.Typer (never a Click object)"
            )
    return None


def _drop_names(
    all_commands: list[Any], commands: list[Any], all_groups: list[Any], groups: list[Any], names: Any
) -> None:
    """Take the commands named ``names`` out of ``commands`` and ``groups`` (entries of ``all_commands`` /
    ``all_groups``); a group added without a name keeps its other commands."""
    for entry in commands:
        if set(command_names([entry], [])) & names:
            all_commands.remove(entry)
    for entry in groups:
        if not set(command_names([], [entry])) & names:
            continue
        sub = entry.typer_instance
        if _group_name(entry) is not None:
            all_groups.remove(entry)
            continue
        # A nameless group contributes its own commands: drop only the shared ones.
        _drop_names(
            sub.registered_commands, list(sub.registered_commands), sub.registered_groups,
            list(sub.registered_groups), names,
        )  # fmt: skip
        if not sub.registered_commands and not sub.registered_groups:
            all_groups.remove(entry)


def _build(commands: list[Any], groups: list[Any]) -> None:
    """Build ``commands`` and ``groups`` as Typer will when the CLI runs, so what cannot be built fails
    now, for its plugin alone."""
    scratch = typer.Typer()
    scratch.registered_commands.extend(commands)
    scratch.registered_groups.extend(groups)
    typer.main.get_group(scratch)


app: typer.Typer  # built on first use (``__getattr__``), not on import


# Held while ``app`` is built; another thread waits for that build, and this thread gets here again only
# from a plugin (``_APP_NOT_YET``).
_app_lock = threading.RLock()
_app_building = False

_APP_NOT_YET = (
    "runlane.cli.main.app is not built until every plugin has loaded and added its commands; add commands in "
    "a register_commands(app) hook instead (see docs/plugin-hooks.md)"
)


def _app() -> typer.Typer:
    global _app_building
    built: typer.Typer | None = globals().get("app")
    if built is not None:
        return built
    with _app_lock:
        built = globals().get("app")
        if built is None:
            # Built now, it would hold only the plugins loaded so far (and be replaced, with the commands a
            # plugin added to it, by the build under way), or build itself again from register_commands.
            if _app_building or loading_plugins():
                raise RuntimeError(_APP_NOT_YET)
            _app_building = True
            try:
                built = globals()["app"] = build_app()
            finally:
                _app_building = False
    return built


# Hidden from type checkers, which would otherwise take any misspelt import from this module as ``Any``;
# they see ``app`` declared above.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        # Importing this module must not load plugins: a plugin imports its helpers (``with_runtime``) from
        # here, often while plugins are being loaded, and the command line is only needed once it runs.
        if name == "app":
            return _app()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ascii_locale_warning(arguments: list[str]) -> str | None:
    """What to say when this process runs under an ASCII locale (``LC_ALL=C`` with Python's locale coercion
    and UTF-8 mode off) and an argument holds non-ASCII UTF-8: Python then reads each of its non-ASCII
    bytes as a lone surrogate, which works for a file name but is not text a run id, key or payload can
    hold, so such an argument is refused where it is used."""
    if codecs.lookup(sys.getfilesystemencoding()).name != "ascii":
        return None
    for argument in arguments:
        if argument.isascii():
            continue
        try:
            os.fsencode(argument).decode("utf-8")
        except UnicodeError:
            continue  # bytes that are not UTF-8 at all: refused where used, with its own message
        return (
            "this process runs under an ASCII locale, so the non-ASCII characters of its arguments are not read "
            "as text; run runlane under a UTF-8 locale (LC_ALL=C.UTF-8) or with PYTHONUTF8=1"
        )
    return None


@contextlib.contextmanager
def _stderr_lines_as_json_warnings(code: str) -> Iterator[None]:
    """Each line written to stderr in the block becomes an ``Output.warning`` of ``code``, JSON on the real
    stderr (the ``runlane: `` prefix of plugin notices dropped). So does each line written to stdout (a
    plugin that prints as it is imported), which carries the command's JSON alone."""
    real, real_stdout = sys.stderr, sys.stdout
    output = Output(json_mode=True, stderr=real)

    def emit(line: str) -> None:
        output.warning(code, line.removeprefix("runlane: "))

    sys.stderr = lines = LineStream(emit, real)
    sys.stdout = printed = LineStream(emit, real)
    try:
        yield
    finally:
        sys.stderr, sys.stdout = real, real_stdout
        lines.finish()
        printed.finish()


def _output_failed(message: str, reason: str) -> NoReturn:
    """Stdout refused the command's output: say so on stderr (as JSON under ``--json``, like any other
    error) and exit 1."""
    if "--json" in sys.argv[1:]:
        error = RunlaneError(ErrorCode.INTERNAL_ERROR, message[0].upper() + message[1:], meta={"reason": reason})
        Output(json_mode=True, stderr=sys.stderr).error(error)
    else:
        sys.stderr.write(f"error: {message}\n")
    raise SystemExit(1) from None


def run() -> None:
    """Console-script entry point."""
    from .output import EXIT_BROKEN_PIPE, OutputLost, stdout_was_closed

    if sys.stdout is None:  # started with stdout closed (>&-): the command runs, its result goes nowhere
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout from now on
    if sys.stderr is None:  # started with stderr closed (2>&-): warnings and errors go nowhere, not to stdout
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process's stderr from now on
    ascii_locale = _ascii_locale_warning(sys.argv[1:])
    if ascii_locale is not None:
        if "--json" in sys.argv[1:]:
            sys.stderr.write(json.dumps({"warning": {"code": "ascii_locale", "message": ascii_locale}}) + "\n")
        else:
            sys.stderr.write(f"warning: {ascii_locale}\n")
    try:
        if "--json" in sys.argv[1:]:
            with _stderr_lines_as_json_warnings("plugin"):
                _app()  # loads the plugins: what they report is read as JSON like the rest of stderr
        _app()(prog_name="runlane")
    except KeyboardInterrupt:
        # A Ctrl-C before the command took the signal over (while plugins load, say): the status a command
        # it ends has, without the traceback of whatever was loading.
        raise SystemExit(128 + signal.SIGINT) from None
    except OutputLost as lost:
        _output_failed(
            f"the command finished, but its result could not be written to stdout ({lost}); "
            "check the runs before running it again.",
            str(lost),
        )
    except OSError as error:
        # Help, usage and version text written straight to a stdout that refuses it (a full disk, a
        # file at its size limit): one line that says so, not a traceback.
        if error.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO):
            raise
        _output_failed(f"the output could not be written ({error.strerror}).", error.strerror or str(error))
    except SystemExit as exit:
        # The command line ends a command whose reader closed the pipe (runlane runs list | head -1)
        # with 1, as if the command had failed, after making stdout ignore the closed pipe.
        if exit.code == 1 and type(sys.stdout).__name__ == "PacifyFlushWrapper":
            raise SystemExit(EXIT_BROKEN_PIPE) from None
        if exit.code in (0, None) and stdout_was_closed():  # a worker stopped because its reader went away
            raise SystemExit(EXIT_BROKEN_PIPE) from None
        raise
