"""``runlane init config``: write a commented ``runlane.toml``. Never loads a runtime; the installed
plugins only tell which lanes exist and, for a lane of another plugin, which options it takes.

An existing file is left alone unless ``--overwrite`` is passed.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import stat
import tempfile
import tomllib
from pathlib import Path, PurePath
from typing import Annotated

import typer
from pydantic import ValidationError

from ..config import RunlaneSection
from ..errors import ErrorCode, RunlaneError, pydantic_message
from ..plugins.manager import get_registries
from .main import guard, state_of
from .options import MULTI_VALUE, MultiValueCommand, checked

__all__ = ["app", "render_config"]

app = typer.Typer(help="Create project files.", no_args_is_help=True)


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


def render_config(*, tasks: list[str], runtime: str | None, lane: str) -> str:
    """The text of a new ``runlane.toml``."""
    lines = [
        "# runlane.toml: how the `runlane` command finds your tasks and the lane they run on.",
        "# Looked up in the working directory (or pass -c/--config PATH).",
        "# ${VAR} and ${VAR:-default} are expanded from the environment; unknown keys are errors.",
        "",
        "[runlane]",
        "# Durable namespace for runs, schedules, idempotency and singleton keys (default: \"default\").",
    ]
    if runtime is not None:
        lines += [
            "# Your runtime sets its own (create_runlane(environment=...)); one written here must match it.",
            '# environment = "production"',
            "",
        ]
    else:
        lines += [
            "# A runtime your code builds with create_runlane() must use the same one to see these runs.",
            '# environment = "production"',
            "",
        ]
    if runtime is not None:
        lines += [
            "# Your own runtime: a Runlane object or a factory (sync or async) returning one.",
            "# It builds its own lane and task catalog, so `tasks` and [lane] are not used.",
            f"runtime = {_toml_string(runtime)}",
            "",
        ]
    else:
        module_list = ", ".join(_toml_string(name) for name in tasks)
        lines += [
            "# Modules to import; every TaskDefinition and QueueDefinition they define is registered.",
            f"tasks = [{module_list}]",
            "",
            '# Or point at your own runtime instead of `tasks` + [lane], written as "module:attribute":',
            '# runtime = "app.runtime:create_app_runlane"',
            "",
            "[lane]",
            '# Any lane a plugin provides: "sqlite" (a durable file, shared by the processes of this machine),',
            '# "local" (in-memory, this process only: `runlane dev` then serves the other commands),',
            '# "postgres-polling", "postgres-sqs", or a third-party lane. Its options follow `use`.',
            f"use = {_toml_string(lane)}",
            *(_lane_options(lane) if lane in _FIRST_PARTY_LANES else _plugin_lane_options(lane)),
            "",
        ]
    lines += [
        "[dev]",
        "# How often `runlane dev` runs maintenance (schedules, recovery, dispatch, outbox).",
        'tick_interval = "5s"',
        "",
        "# Durable observation exporters; each consumer keeps its own checkpoint.",
        "# [[exporters]]",
        '# use = "console"',
        '# consumer = "local_console"',
        "",
    ]
    return "\n".join(lines)


_FIRST_PARTY_LANES = frozenset({"local", "sqlite", "postgres-polling", "postgres-sqs"})


def _plugin_lane_options(lane: str) -> list[str]:
    """The options of another plugin's lane, read off its options model: each commented out, a required
    one to fill in (left unset, every command stops naming it) and an optional one with its default."""
    provider = get_registries().lanes.get(lane)
    fields = provider.options_model.model_fields
    if not fields:
        return []
    lines = [f"# The options of {lane!r} (plugin {provider.plugin!r}); uncomment and set the required ones."]
    for name, info in fields.items():
        note = " ".join((info.description or "").split())
        if info.is_required():
            lines.append(f"# {info.alias or name} =   # required{': ' + note if note else ''}")
            continue
        default = _toml_value(info.get_default(call_default_factory=True))
        assignment = f"# {info.alias or name} = {default}" if default is not None else f"# {info.alias or name} ="
        lines.append(f"{assignment}   # {note}" if note else assignment)
    return lines


def _toml_value(value: object) -> str | None:
    """``value`` as a TOML value the options model reads back as ``value``, when it is a string (an enum
    member's or a path's too), a number, a boolean or a list of them."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, PurePath):
        value = str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value.replace("$", "$$"))  # the config expands ${VAR}; $$ is a literal $
    if isinstance(value, int | float) and value == value and value not in (float("inf"), float("-inf")):
        return repr(value)
    if isinstance(value, list | tuple):
        items = [_toml_value(item) for item in value]
        return None if None in items else "[" + ", ".join(item for item in items if item is not None) + "]"
    return None


def _lane_options(lane: str) -> list[str]:
    """Starter options for the first-party lanes (each plugin validates its own)."""
    if lane == "sqlite":
        return ["# The database file, relative to this config file.", 'path = "runlane.db"']
    if lane == "postgres-polling":
        return [
            "# Apply the schema first with `runlane postgres migrate`. Without DATABASE_URL set, commands",
            "# refuse to start, naming this key (a fallback URL here would hide a deploy that forgot it).",
            'connection_string = "${DATABASE_URL}"',
            '# schema = "public"',
        ]
    if lane == "postgres-sqs":
        return [
            "# Apply the schema first with `runlane postgres migrate`; consume with `runlane sqs consume`.",
            "[lane.postgres]",
            'connection_string = "${DATABASE_URL}"   # unset: commands refuse to start, naming this key',
            '# schema = "public"',
            "",
            "# The SQS client: region, credentials and endpoint come from the AWS environment when left out.",
            "[lane.sqs]",
            '# region = "us-east-1"',
            '# endpoint_url = "http://localhost:4566"   # an SQS-compatible server for local runs',
            "",
            "# One table per queue your tasks register: queue_url, or queue_name (resolved once).",
            "[lane.sqs.queues.default]",
            'queue_url = "${RUNLANE_DEFAULT_QUEUE_URL}"',
            "# fifo = true                               # for a queue whose name ends in .fifo",
        ]
    return []


@app.command("config", cls=MultiValueCommand)
def init_config(
    ctx: typer.Context,
    path: Annotated[
        Path | None,
        typer.Option(
            "--path", help="Where to write the config (default: -c/--config, else runlane.toml).", metavar="PATH"
        ),
    ] = None,
    tasks: Annotated[
        list[str] | None,
        typer.Option(
            "--tasks",
            help=f"Task module to import; {MULTI_VALUE} (default, without --runtime: app.tasks).",
            metavar="MODULE...",
            callback=checked(lambda names, name: _check_section(tasks=list(names))),
        ),
    ] = None,
    runtime: Annotated[
        str | None,
        typer.Option(
            "--runtime",
            help="Your runtime or factory as module:attribute.",
            metavar="MODULE:ATTR",
            callback=checked(lambda target, name: _check_section(runtime=target)),
        ),
    ] = None,
    lane: Annotated[
        str | None,
        typer.Option(
            "--lane",
            help="Lane provider name, one a plugin installed here provides (default, without --runtime: sqlite, "
            "the durable single-machine lane).",
            metavar="NAME",
            callback=checked(lambda name, flag: get_registries().lanes.get(name)),
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing file.")] = False,
) -> None:
    """Write a commented runlane.toml."""
    output = state_of(ctx).output

    if runtime is not None and tasks:
        ctx.fail("--runtime and --tasks exclude each other: the runtime factory registers its own tasks; pass one.")
    if runtime is not None and lane is not None:
        ctx.fail("--runtime and --lane exclude each other: the runtime factory builds its own lane; pass one.")
    path = _target(ctx, path)
    if path.name == "pyproject.toml":
        ctx.fail(
            f"Writing {path} would replace your pyproject.toml with a runlane.toml; write a runlane.toml, "
            "or copy its tables into pyproject.toml under [tool.runlane] ([tool.runlane.runlane], "
            "[tool.runlane.lane], ...)."
        )

    def prepare() -> str:
        if path.is_dir():
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"{path} is a directory; give --path the file to write, such as {path / 'runlane.toml'}.",
                meta={"path": str(path)},
            )
        if path.exists() and not path.is_file():
            # --overwrite replaces a config file; renamed over a device (/dev/null), a FIFO or a socket, it
            # would put a regular file in its place.
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"{path} is not a regular file, so it is not a config to replace; give --path the file to write.",
                meta={"path": str(path)},
            )
        if path.exists() and not overwrite:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"{path} already exists; pass --overwrite to replace it or --path to write elsewhere.",
                meta={"path": str(path)},
            )
        shadowed = _configured_pyproject(path)
        if shadowed is not None and not overwrite:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"{shadowed} already holds a Runlane config ([tool.runlane]), and a {path.name} beside it would "
                "take its place for every command run there; edit that table instead, or pass --overwrite to "
                "write it anyway (--path to write elsewhere).",
                meta={"path": str(shadowed)},
            )
        return render_config(tasks=list(tasks or ["app.tasks"]), runtime=runtime, lane=lane or "sqlite")

    text = guard(ctx, prepare)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(path, text)
    except OSError as error:
        reason = error.strerror or str(error)  # not the name of the temporary file it was written through
        failure = RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Cannot write {path}: {reason}; check that its directory exists and is writable, or give --path.",
            meta={"path": str(path)},
        )
        guard(ctx, lambda: _raise(failure))
    output.file_written(str(path), overwritten=existed)
    if not tasks and runtime is None and not _module_beside(path, "app.tasks"):
        output.warning(
            "placeholder_tasks",
            f"{path} names the task module app.tasks, a placeholder: change [runlane] tasks to your module, "
            "or write it again with --tasks MODULE.",
        )


def _module_beside(path: Path, module: str) -> bool:
    """Whether the folder of the config at ``path`` (where its commands import tasks from) holds ``module``."""
    base = path.parent.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _configured_pyproject(path: Path) -> Path | None:
    """The ``pyproject.toml`` beside ``path``, a ``runlane.toml``, when it holds a ``[tool.runlane]`` table: the
    commands run in that folder read the ``runlane.toml`` first, so writing it would silently replace that
    config. One that cannot be read holds none that could be replaced."""
    if path.name != "runlane.toml":
        return None
    pyproject = path.parent / "pyproject.toml"
    try:
        document = tomllib.loads(pyproject.read_text(encoding="utf-8-sig"))  # as the config loader reads it
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    tool = document.get("tool")
    return pyproject if isinstance(tool, dict) and "runlane" in tool else None


def _target(ctx: typer.Context, path: Path | None) -> Path:
    """Where to write: ``--path``, else the ``-c/--config`` the later commands will be given (a config written
    anywhere else would not be the one they read), else ``runlane.toml``; the two naming different files is
    a usage error."""
    config = state_of(ctx).config_path
    if path is None:
        return config if config is not None else Path("runlane.toml")
    if config is not None and os.path.realpath(config) != os.path.realpath(path):
        ctx.fail(
            f"-c/--config {config} and --path {path} name different files; pass one of them "
            "(-c/--config alone writes the config there)."
        )
    return path


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: into a file beside it, renamed over it once complete, so a full
    disk leaves neither an empty nor a cut-off config behind (nor a previous one damaged)."""
    path = Path(os.path.realpath(path))  # a config kept elsewhere behind a symbolic link is written there
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        if path.exists():  # keep the mode of the file it replaces
            os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
        else:
            os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _raise(error: RunlaneError) -> None:
    raise error


def _check_section(**fields: object) -> None:
    """``[runlane]`` would accept these values (module names, a ``module:attribute`` runtime)."""
    try:
        RunlaneSection.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(pydantic_message(detail) for detail in error.errors())
        raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"{problems}.") from None
