"""``runlane.toml``: finding it, expanding ``${VAR}`` references, validating it, and building the runtime.

This module owns configuration discovery (``find_config``, the one function tests point elsewhere
through ``cwd``), environment expansion, strict validation of the ``[runlane]``, ``[lane]``, ``[dev]``
and ``[[exporters]]`` tables, and turning a validated config into a ``Runlane`` (``load_runtime`` /
``build_runtime``). It does not load plugins or validate lane and exporter options: those tables keep
their options as plain dicts for the providing plugin to validate, and the caller supplies the
``lane_factory`` that does so.

``[tool.runlane]`` in ``pyproject.toml`` mirrors a whole ``runlane.toml``: ``[tool.runlane.runlane]``,
``[tool.runlane.lane]``, ``[tool.runlane.dev]`` and ``[[tool.runlane.exporters]]``.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import json
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .core.authoring import QueueDefinition, TaskDefinition
from .core.lanes import Lane
from .core.runtime import Runlane, create_runlane, environment_name_problem
from .defaults import contract_defaults
from .durations import duration_ms
from .errors import ErrorCode, RunlaneError, pydantic_message
from .ids import validate_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 and older read TOML through the tomli backport
    import tomli as tomllib

__all__ = [
    "CONFIG_FILE_NAME",
    "PYPROJECT_FILE_NAME",
    "ConfigSource",
    "DevConfig",
    "ExporterConfig",
    "LaneConfig",
    "LoadedConfig",
    "RunlaneConfig",
    "RunlaneSection",
    "build_runtime",
    "expand_environment",
    "find_config",
    "load_config",
    "load_runtime",
    "parse_config",
]

CONFIG_FILE_NAME = "runlane.toml"
PYPROJECT_FILE_NAME = "pyproject.toml"
DEFAULT_TICK_INTERVAL = "5s"

LaneFactory = Callable[[str, dict[str, Any]], "Lane | Awaitable[Lane]"]

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOML_POSITION = re.compile(r"\(at line (\d+), column (\d+)\)")


def _invalid(message: str, *, cause: BaseException | None = None, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta, cause=cause)


def _suggestion(key: str, allowed: Sequence[str]) -> str:
    matches = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


# ---------------------------------------------------------------------------------------------
# Discovery


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """A configuration file found on disk: its resolved absolute ``path`` and its raw ``table``.

    ``table`` is the whole ``runlane.toml`` document, or the ``[tool.runlane]`` table of a
    ``pyproject.toml`` (then ``table_prefix`` is ``"tool.runlane."``, used to name tables in errors).
    ``display`` is how messages name the file: relative to the working directory when it lies below it.
    """

    path: Path
    table: dict[str, Any] = field(repr=False)  # may hold secrets written inline
    table_prefix: str = ""
    display: str = ""

    @property
    def base_dir(self) -> Path:
        """The directory the file lives in: module imports and relative lane paths resolve against it."""
        return self.path.parent

    @property
    def is_pyproject(self) -> bool:
        return self.table_prefix != ""

    def table_name(self, name: str) -> str:
        return f"{self.table_prefix}{name}"


def find_config(explicit: str | Path | None = None, *, cwd: Path | None = None) -> ConfigSource | None:
    """Find the configuration: ``explicit`` (``-c/--config``) wins, then ``runlane.toml``, then ``pyproject.toml``.

    ``cwd`` (default: the process working directory) is where the search happens and what a relative
    ``explicit`` path resolves against. An explicit path that does not exist is ``configuration_invalid``;
    when nothing is found the result is ``None``. A ``pyproject.toml`` counts only when it has a
    ``[tool.runlane]`` table.
    """
    base = Path.cwd() if cwd is None else Path(cwd)
    base = base.resolve()
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_absolute():
            path = base / path
        path = path.resolve()
        if not path.exists():
            raise _invalid(
                f"Config file {str(explicit)!r} does not exist; check the -c/--config path.",
                path=str(path),
            )
        if not path.is_file():
            raise _invalid(
                f"Config path {str(explicit)!r} is not a file; pass the path of a runlane.toml.", path=str(path)
            )
        if path.name == PYPROJECT_FILE_NAME:
            source = _read_pyproject(path, base)
            if source is None:
                raise _invalid(
                    f"{_display(path, base)}: no [tool.runlane] table; add one or pass a runlane.toml.", path=str(path)
                )
            return source
        return ConfigSource(path=path, table=_read_toml(path, base), display=_display(path, base))

    candidate = base / CONFIG_FILE_NAME
    if candidate.is_file():
        return ConfigSource(path=candidate, table=_read_toml(candidate, base), display=_display(candidate, base))
    pyproject = base / PYPROJECT_FILE_NAME
    if pyproject.is_file():
        return _read_pyproject(pyproject, base)
    return None


def _display(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _read_toml(path: Path, base: Path) -> dict[str, Any]:
    display = _display(path, base)
    try:
        # utf-8-sig: a byte order mark some Windows editors write first is not TOML's to refuse at "line 1, column 1"
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise _invalid(f"{display}: cannot read the file: {error}", path=str(path), cause=error) from error
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        meta: dict[str, Any] = {"path": str(path)}
        position = _TOML_POSITION.search(str(error))
        if position is not None:
            meta["line"] = int(position.group(1))
            meta["column"] = int(position.group(2))
        raise _invalid(f"{display}: invalid TOML: {error}", cause=error, **meta) from error


def _read_pyproject(path: Path, base: Path) -> ConfigSource | None:
    document = _read_toml(path, base)
    tool = document.get("tool")
    if not isinstance(tool, dict) or "runlane" not in tool:
        return None
    table = tool["runlane"]
    display = _display(path, base)
    if not isinstance(table, dict):
        raise _invalid(f"{display}: [tool.runlane] must be a table.", path=str(path), table="tool.runlane")
    return ConfigSource(path=path, table=table, table_prefix="tool.runlane.", display=display)


# ---------------------------------------------------------------------------------------------
# ${VAR} expansion


class _MissingVariable(Exception):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(name)
        self.name = name
        self.problem = problem


def _closing_brace(value: str, start: int) -> int:
    """The index of the ``}`` closing the reference whose body starts at ``start`` (nested ``${...}``
    included), or -1."""
    depth = 0
    index = start
    while index < len(value):
        if value.startswith("$$", index):
            index += 2
            continue
        if value.startswith("${", index):
            depth += 1
            index += 2
            continue
        if value[index] == "}":
            if depth == 0:
                return index
            depth -= 1
        index += 1
    return -1


def _expand_string(value: str, environ: Mapping[str, str]) -> str:
    out: list[str] = []
    index = 0
    length = len(value)
    while index < length:
        char = value[index]
        if char != "$":
            out.append(char)
            index += 1
            continue
        following = value[index + 1 : index + 2]
        if following == "$":
            out.append("$")
            index += 2
            continue
        if following != "{":
            out.append("$")
            index += 1
            continue
        end = _closing_brace(value, index + 2)
        if end == -1:
            raise _MissingVariable(value[index:], "has no closing '}'; write $$ for a literal '$'")
        body = value[index + 2 : end]
        name, separator, default = body.partition(":-")
        if not _ENV_NAME.fullmatch(name):
            raise _MissingVariable(
                "${" + body + "}", "is not a valid variable reference; use ${NAME} or ${NAME:-default}"
            )
        current = environ.get(name)
        if separator:
            # A default may hold references of its own (${A:-${B}}), expanded only when it is used.
            out.append(current if current else _expand_string(default, environ))
        elif current is None:
            raise _MissingVariable(name, "is not set")
        else:
            out.append(current)
        index = end + 1
    return "".join(out)


def expand_environment(value: Any, environ: Mapping[str, str], *, path: tuple[str | int, ...] = ()) -> Any:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in every string inside ``value`` (``$$`` is a literal ``$``).

    ``:-`` uses the default when the variable is unset or empty, as in a shell. Raises
    ``_MissingVariable`` tagged with the key path; ``parse_config`` turns it into ``configuration_invalid``.
    """
    if isinstance(value, str):
        try:
            return _expand_string(value, environ)
        except _MissingVariable as error:
            error.path = path  # type: ignore[attr-defined]
            raise
    if isinstance(value, dict):
        return {key: expand_environment(item, environ, path=(*path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_environment(item, environ, path=(*path, position)) for position, item in enumerate(value)]
    return value


# ---------------------------------------------------------------------------------------------
# Models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunlaneSection(_Strict):
    """``[runlane]``: the durable environment and where the runtime comes from."""

    environment: str = Field(default=contract_defaults.environment, min_length=1)
    tasks: list[str] = Field(default_factory=list)
    runtime: str | None = None

    @field_validator("environment", mode="before")
    @classmethod
    def _environment_name(cls, value: Any) -> Any:
        # Before pydantic's own string check, which calls a lone surrogate "raw data" it cannot parse.
        problem = environment_name_problem(value) if isinstance(value, str) and value else None
        if problem is not None:
            raise ValueError(f"{problem}; name it with plain text, such as 'production'")
        return value

    @field_validator("tasks", mode="before")
    @classmethod
    def _module_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # `tasks = "app.tasks"`: say how to write it, not "a valid list"
            raise ValueError(f"write a list of module names, even for one: tasks = [{json.dumps(value)}]")
        return value

    @field_validator("tasks")
    @classmethod
    def _module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a module name; write a dotted import path such as 'app.tasks'")
        return value

    @field_validator("runtime")
    @classmethod
    def _runtime_target(cls, value: str | None) -> str | None:
        if value is None:
            return value
        module, separator, attribute = value.partition(":")
        if not separator or not _MODULE_NAME.fullmatch(module) or not _MODULE_NAME.fullmatch(attribute):
            raise ValueError(
                f"{value!r} must be written as 'module:attribute', such as 'app.runtime:create_app_runlane'"
            )
        return value


class _OptionNames:
    """Stands for a plugin's options in a repr: their names, never their values (after ``${VAR}``
    expansion a connection string, a password or an API key header)."""

    __slots__ = ("_names",)

    def __init__(self, names: Iterable[str]) -> None:
        self._names = tuple(names)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{name!r}: ..." for name in self._names) + "}"


class _WithOptions(_Strict):
    """A table whose ``options`` belong to a plugin: its repr (and str) names them without their values."""

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, _OptionNames(value) if name == "options" and isinstance(value, dict) else value


def _split_options(data: Any, fixed: tuple[str, ...]) -> Any:
    """Move every key other than ``fixed`` into ``options``: those belong to the providing plugin."""
    if not isinstance(data, dict):
        return data
    kept = {key: data[key] for key in fixed if key in data}
    kept["options"] = {key: value for key, value in data.items() if key not in fixed}
    return kept


class LaneConfig(_WithOptions):
    """``[lane]``: ``use`` names a lane provider; every other key is an option for that provider."""

    use: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _collect_options(cls, data: Any) -> Any:
        return _split_options(data, ("use",))


class ExporterConfig(_WithOptions):
    """One ``[[exporters]]`` entry: the provider, its checkpoint consumer name, and the provider's options."""

    use: str = Field(min_length=1)
    consumer: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _collect_options(cls, data: Any) -> Any:
        return _split_options(data, ("use", "consumer"))

    @field_validator("consumer")
    @classmethod
    def _consumer_id(cls, value: str) -> str:
        try:
            return validate_id(value, "consumer")
        except RunlaneError as error:
            raise ValueError(error.message) from None


class DevConfig(_Strict):
    """``[dev]``: settings of ``runlane dev``."""

    tick_interval: str = DEFAULT_TICK_INTERVAL

    @field_validator("tick_interval", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if not isinstance(value, str):  # `tick_interval = 5`: say what to write, not "a valid string"
            raise ValueError(f"Invalid tick_interval {value!r}: write a duration string such as \"5s\" or \"500ms\".")
        try:
            duration_ms(value, "tick_interval")
        except RunlaneError as error:
            raise ValueError(error.message) from None
        return value

    @property
    def tick_interval_ms(self) -> int:
        return duration_ms(self.tick_interval, "tick_interval")


class RunlaneConfig(_Strict):
    """The whole document. ``runtime`` excludes ``tasks`` and ``[lane]``; without it ``[lane]`` is required."""

    runlane: RunlaneSection = Field(default_factory=RunlaneSection)
    lane: LaneConfig | None = None
    dev: DevConfig = Field(default_factory=DevConfig)
    exporters: list[ExporterConfig] = Field(default_factory=list)

    @field_validator("exporters")
    @classmethod
    def _one_exporter_per_consumer(cls, value: list[ExporterConfig]) -> list[ExporterConfig]:
        # One checkpoint per consumer: two loops sharing one would race for it and split the records.
        first: dict[str, int] = {}
        for number, entry in enumerate(value, start=1):
            if entry.consumer in first:
                raise ValueError(
                    f"entries #{first[entry.consumer]} and #{number} share consumer {entry.consumer!r}; each "
                    "exporter needs its own consumer name (it names the checkpoint of what it has exported)"
                )
            first[entry.consumer] = number
        return value


# Tables whose unknown keys are rejected by name (``[lane]`` and ``[[exporters]]`` collect theirs as options).
_CHECKED_TABLES: tuple[tuple[str | None, type[BaseModel]], ...] = (
    (None, RunlaneConfig),
    ("runlane", RunlaneSection),
    ("dev", DevConfig),
)


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A validated configuration and the file it came from."""

    source: ConfigSource
    config: RunlaneConfig
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def base_dir(self) -> Path:
        return self.source.base_dir

    @property
    def runlane(self) -> RunlaneSection:
        return self.config.runlane

    @property
    def lane(self) -> LaneConfig | None:
        return self.config.lane

    @property
    def dev(self) -> DevConfig:
        return self.config.dev

    @property
    def exporters(self) -> list[ExporterConfig]:
        return self.config.exporters

    @property
    def environment(self) -> str:
        return self.config.runlane.environment


# ---------------------------------------------------------------------------------------------
# Parsing and validation


def load_config(
    explicit: str | Path | None = None,
    *,
    cwd: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedConfig | None:
    """``find_config`` then ``parse_config``; ``None`` when there is no configuration to find."""
    source = find_config(explicit, cwd=cwd)
    return None if source is None else parse_config(source, environ=environ)


def parse_config(source: ConfigSource, *, environ: Mapping[str, str] | None = None) -> LoadedConfig:
    """Expand ``${VAR}`` references (from ``environ``, default ``os.environ``) and validate strictly."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    where = source.display or str(source.path)
    try:
        table = expand_environment(source.table, env)
    except _MissingVariable as error:
        key_path: tuple[str | int, ...] = getattr(error, "path", ())
        location = _describe_location(source, key_path)
        if error.problem == "is not set":
            message = (
                f"{where}: {location}: environment variable {error.name!r} is not set; "
                f"export it or write ${{{error.name}:-default}}."
            )
        else:
            message = f"{where}: {location}: {error.name!r} {error.problem}."
        raise _invalid(message, path=str(source.path), variable=error.name, key=_dotted(key_path)) from None

    _reject_unknown_keys(source, table)
    try:
        config = RunlaneConfig.model_validate(table)
    except ValidationError as error:
        raise _from_validation_error(source, error) from None

    if config.runlane.runtime is not None:
        clashes = []
        if "tasks" in config.runlane.model_fields_set:
            clashes.append(f"[{source.table_name('runlane')}] tasks")
        if config.lane is not None:
            clashes.append(f"[{source.table_name('lane')}]")
        if clashes:
            raise _invalid(
                f"{where}: [{source.table_name('runlane')}] runtime excludes {' and '.join(clashes)}: "
                "the runtime factory builds its own lane and task catalog; remove one or the other.",
                path=str(source.path),
                table=source.table_name("runlane"),
                key="runtime",
            )
    elif config.lane is None:
        raise _invalid(
            f"{where}: no [{source.table_name('lane')}] table; add one (for example use = \"local\") "
            f"or set [{source.table_name('runlane')}] runtime = \"module:attribute\".",
            path=str(source.path),
            table=source.table_name("lane"),
        )
    return LoadedConfig(source=source, config=config, environ=env)


def _dotted(path: Sequence[str | int]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _describe_location(source: ConfigSource, path: Sequence[str | int]) -> str:
    """``[lane] connection_string`` / ``[[exporters]] #2 consumer`` / ``top-level key 'x'``."""
    if not path:
        return "top level"
    head, rest = path[0], list(path[1:])
    if head == "exporters" and rest and isinstance(rest[0], int):
        table = f"[[{source.table_name('exporters')}]] #{rest[0] + 1}"
        rest = rest[1:]
    elif head == "exporters":
        table = f"[[{source.table_name('exporters')}]]"
    else:
        table = f"[{source.table_name(str(head))}]"
    return f"{table} {_dotted(rest)}".rstrip() if rest else table


def _reject_unknown_keys(source: ConfigSource, table: Mapping[str, Any]) -> None:
    where = source.display or str(source.path)
    for name, model in _CHECKED_TABLES:
        section = table if name is None else table.get(name)
        if not isinstance(section, Mapping):
            continue  # a wrong type is reported by validation
        allowed = list(model.model_fields)
        for key in section:
            if key in allowed:
                continue
            if name is None:
                raise _invalid(
                    f"{where}: {_unknown_top_level(source, key, allowed)}",
                    path=str(source.path),
                    table=source.table_name(key),
                    key=key,
                )
            raise _invalid(
                f"{where}: [{source.table_name(name)}] unknown key {key!r}{_suggestion(key, allowed)}; "
                f"allowed keys: {', '.join(allowed)}.",
                path=str(source.path),
                table=source.table_name(name),
                key=key,
            )


def _unknown_top_level(source: ConfigSource, key: str, allowed: Sequence[str]) -> str:
    if key in RunlaneSection.model_fields:
        return f"key {key!r} belongs in the [{source.table_name('runlane')}] table; move it below that header."

    def header(name: str) -> str:
        return f"[[{source.table_name(name)}]]" if name == "exporters" else f"[{source.table_name(name)}]"

    matches = difflib.get_close_matches(key, list(allowed), n=1)
    hint = f" (did you mean {header(matches[0])}?)" if matches else ""
    return f"unknown table [{source.table_name(key)}]{hint}; the tables are {', '.join(header(a) for a in allowed)}."


def _from_validation_error(source: ConfigSource, error: ValidationError) -> RunlaneError:
    where = source.display or str(source.path)
    problems: list[str] = []
    keys: list[str] = []
    for detail in error.errors():
        loc: list[str | int] = list(detail["loc"])
        if not loc:
            problems.append(f"top level: {detail['msg']}")
            continue
        table_loc: list[str | int] = [loc[0]]
        if loc[0] == "exporters" and len(loc) > 1 and isinstance(loc[1], int):
            table_loc.append(loc[1])
        key_parts = loc[len(table_loc) :]
        location = _describe_location(source, table_loc)
        keys.append(_dotted(loc))
        message = pydantic_message(detail)
        if detail["type"] == "model_type" and not key_parts:
            # pydantic's text names the model class (LaneConfig); the user wrote a TOML value, not a table.
            problems.append(
                f"{location} must be a table, not {_toml_kind(detail['input'])}: write {location.split(' ')[0]} "
                "on a line of its own, its keys below it"
            )
        elif detail["type"] == "list_type" and table_loc == ["exporters"]:
            problems.append(
                f"{location} must be an array of tables, not {_toml_kind(detail['input'])}: give each exporter "
                f"its own {location} header line (two brackets), its keys below it"
            )
        elif detail["type"] == "missing" and key_parts:
            problems.append(f"{location} missing key {_dotted(key_parts)!r}")
        elif detail["type"] == "extra_forbidden" and key_parts:
            problems.append(f"{location} unknown key {_dotted(key_parts)!r}")
        elif key_parts:
            problems.append(f"{location} key {_dotted(key_parts)!r}: {message}")
        else:
            problems.append(f"{location}: {message}")
    return _invalid(f"{where}: {'; '.join(problems)}.", path=str(source.path), keys=keys)


def _toml_kind(value: Any) -> str:
    """What a TOML value is, as the TOML specification names it: ``a string``, ``a table``, ..."""
    kinds: tuple[tuple[type, str], ...] = (
        (bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"), (dict, "a table"),
        (list, "an array"),
    )  # fmt: skip
    return next((name for type_, name in kinds if isinstance(value, type_)), "a date or time")


# ---------------------------------------------------------------------------------------------
# Building the runtime


def load_runtime(
    config: LoadedConfig,
    *,
    lane_factory: LaneFactory,
    task_modules: Sequence[str] | Mapping[str, str] = (),
    observers: Sequence[Callable[..., Any]] = (),
) -> Runlane:
    """Build the configured runtime from synchronous code.

    An async runtime factory or lane factory is run to completion on a fresh event loop; from inside a
    running event loop use ``await build_runtime(...)`` instead.
    """
    steps = _runtime_steps(config, lane_factory, task_modules, observers)
    try:
        pending = next(steps)
        while True:
            try:
                result = _run_to_completion(pending)
            except Exception as error:
                pending = steps.throw(error)
            else:
                pending = steps.send(result)
    except StopIteration as done:
        return done.value


async def build_runtime(
    config: LoadedConfig,
    *,
    lane_factory: LaneFactory,
    task_modules: Sequence[str] | Mapping[str, str] = (),
    observers: Sequence[Callable[..., Any]] = (),
) -> Runlane:
    """Build the configured runtime, awaiting async runtime factories and lane factories.

    With ``[runlane] runtime = "module:attribute"`` the attribute is a ``Runlane`` or a factory (sync or
    async, no arguments) returning one. Otherwise every ``TaskDefinition`` and ``QueueDefinition`` at
    module level in ``[runlane] tasks`` (and ``task_modules``, such as plugin contributions, given as
    a mapping of module to plugin name so an import failure names the plugin) is
    registered on ``create_runlane(lane=lane_factory(use, options), ...)``.
    """
    steps = _runtime_steps(config, lane_factory, task_modules, observers)
    try:
        pending = next(steps)
        while True:
            try:
                result = await pending
            except Exception as error:
                pending = steps.throw(error)
            else:
                pending = steps.send(result)
    except StopIteration as done:
        return done.value


def _run_to_completion(awaitable: Awaitable[Any]) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        raise _invalid(
            "load_runtime() met an async factory inside a running event loop; use `await build_runtime(...)` there."
        )

    async def wait() -> Any:
        return await awaitable

    return asyncio.run(wait())


# Yields awaitables for the driver (sync or async) to resolve and send back; returns the runtime.
_Steps = Generator[Awaitable[Any], Any, Runlane]


def _runtime_steps(
    config: LoadedConfig,
    lane_factory: LaneFactory,
    task_modules: Sequence[str] | Mapping[str, str],
    observers: Sequence[Callable[..., Any]],
) -> _Steps:
    source = config.source
    where = source.display or str(source.path)
    section = config.runlane
    _add_search_path(source.base_dir)

    if section.runtime is not None:
        module_name, _, attribute = section.runtime.partition(":")
        target = _import_attribute(source, module_name, attribute)
        value: Any = target
        if not isinstance(target, Runlane):
            if not callable(target):
                raise _invalid(
                    f"{where}: [{source.table_name('runlane')}] runtime {section.runtime!r} is neither a Runlane "
                    f"nor a factory returning one (got {type(target).__name__}).",
                    path=str(source.path),
                    runtime=section.runtime,
                )
            try:
                value = target()
                if inspect.isawaitable(value):
                    value = yield value
            except RunlaneError:
                raise
            except (Exception, SystemExit) as error:  # sys.exit() in it must not end the command as if it had run
                raise _invalid(
                    f"{where}: runtime factory {section.runtime!r} failed: {type(error).__name__}: {error}",
                    path=str(source.path),
                    runtime=section.runtime,
                    cause=error,
                ) from error
        if not isinstance(value, Runlane):
            raise _invalid(
                f"{where}: runtime factory {section.runtime!r} returned {type(value).__name__}, not a Runlane; "
                "return create_runlane(...).",
                path=str(source.path),
                runtime=section.runtime,
            )
        if "environment" in section.model_fields_set and value.environment.name != section.environment:
            raise _invalid(
                f"{where}: [{source.table_name('runlane')}] environment is {section.environment!r} but the runtime "
                f"from {section.runtime!r} uses {value.environment.name!r}; remove one of them.",
                path=str(source.path),
            )
        value.attach_observers(observers)  # plugin observers watch every runtime built from configuration
        return value

    lane_config = config.lane
    assert lane_config is not None  # parse_config requires [lane] without runtime
    module_names = list(dict.fromkeys([*section.tasks, *task_modules]))
    owners = {} if not isinstance(task_modules, Mapping) else {
        module: plugin for module, plugin in task_modules.items() if module not in section.tasks
    }
    queues, tasks = _collect_definitions(source, module_names, owners)
    lane = lane_factory(lane_config.use, dict(lane_config.options))
    if inspect.isawaitable(lane):
        lane = yield lane
    if not queues:
        raise _invalid(
            f"{where}: the modules of [{source.table_name('runlane')}] tasks ({', '.join(module_names) or 'none'}) "
            "define no queue; define one at module level next to your tasks: "
            "default = queue(\"default\", default=True).",
            path=str(source.path),
        )
    return create_runlane(
        lane=lane,
        queues=queues,
        tasks=tasks,
        environment=section.environment,
        observers=observers,
    )


def _add_search_path(directory: Path) -> None:
    entry = str(directory)
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _import_module(source: ConfigSource, name: str, key: str, *, plugin: str | None = None) -> ModuleType:
    where = source.display or str(source.path)
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as error:  # sys.exit() at import must not end the command as if it had run
        location = _application_frame(error)
        whose = (
            f"plugin {plugin!r} registers task module {name!r} (register_task_modules), which cannot be imported"
            if plugin is not None
            else f"{where}: [{source.table_name('runlane')}] {key}: cannot import module {name!r}"
        )
        if plugin is not None:
            hint = "; fix or uninstall the plugin, or leave it out of RUNLANE_LOAD_PLUGINS"
        elif isinstance(error, ModuleNotFoundError) and error.name and f"{name}.".startswith(f"{error.name}."):
            # The module itself (or its package) is not there, not something it imports.
            hint = (
                f"; modules are imported from the config file's directory ({source.base_dir}) and the Python path: "
                "check the name, or give -c the config file of the project that holds the module"
            )
        else:
            hint = ""
        # A SyntaxError's own text names only the file's base name (tasks.py), which one module importing
        # another of that name makes the wrong file: its message is given with the file's path instead.
        text = error.msg if isinstance(error, SyntaxError) and location else str(error)
        raise _invalid(
            f"{whose}: {type(error).__name__}: {text}"
            + (f" ({location[0]}, line {location[1]})" if location else "")
            + (_EXITS_ON_IMPORT if isinstance(error, SystemExit) else "")
            + hint,
            path=str(source.path),
            module=name,
            cause=error,
            **({"file": location[0], "line": location[1]} if location else {}),
        ) from error


_EXITS_ON_IMPORT = (
    "; the module exits as it is imported (a script's entry point not under `if __name__ == \"__main__\":`?)"
)


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    roots.add(str(Path(__file__).resolve().parent))  # runlane itself, also when installed in editable mode
    return tuple(str(Path(root).resolve()) + os.sep for root in roots)


def _application_frame(error: BaseException) -> tuple[str, int] | None:
    """The innermost frame of the application's own code in ``error``'s traceback: the line to fix.

    Import machinery, the standard library, installed packages and Runlane are skipped, so a
    ``task(...)`` call with a bad argument points at the call, not at the check that refused it. For a
    ``SyntaxError`` (an ``IndentationError``, a ``TabError``) it is the file and line that could not be
    compiled.
    """
    if isinstance(error, SyntaxError):
        if error.filename is None or error.lineno is None or error.filename.startswith("<"):
            return None
        return _display_path(error.filename), error.lineno
    roots = _library_roots()
    found: tuple[str, int] | None = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        filename = frame.f_code.co_filename
        if filename.startswith("<") or str(Path(filename).resolve()).startswith(roots):
            continue
        found = (_display_path(filename), line)
    return found


def _display_path(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename


def _import_attribute(source: ConfigSource, module_name: str, attribute: str) -> Any:
    module = _import_module(source, module_name, "runtime")
    value: Any = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            where = source.display or str(source.path)
            raise _invalid(
                f"{where}: [{source.table_name('runlane')}] runtime: module {module_name!r} has no attribute "
                f"{attribute!r}.",
                path=str(source.path),
                module=module_name,
                attribute=attribute,
            ) from None
    return value


def _collect_definitions(
    source: ConfigSource, module_names: Sequence[str], owners: Mapping[str, str] | None = None
) -> tuple[list[QueueDefinition], list[TaskDefinition]]:
    """Every module-level task and queue, deduplicated; queues referenced only by a task are included.
    ``owners`` names the plugin that contributed a module (not listed in ``[runlane] tasks``)."""
    tasks: list[TaskDefinition] = []
    seen_tasks: set[int] = set()
    queues: list[QueueDefinition] = []
    task_modules: dict[str, str] = {}  # task id -> the module that defines it
    task_names: dict[str, str] = {}  # task id -> the module attribute that holds it
    queue_modules: dict[str, tuple[QueueDefinition, str]] = {}  # queue name -> its first definition and module
    where = source.display or str(source.path)

    def described(module: str) -> str:
        plugin = (owners or {}).get(module)
        return f"module {module!r}" + (f" (from plugin {plugin!r})" if plugin else "")

    def add_queue(candidate: QueueDefinition, module: str) -> None:
        # Equal queue definitions are the same queue to the runtime; a same-named different one is
        # a conflict, named with both modules.
        first = queue_modules.setdefault(candidate.name, (candidate, module))
        if first[0] != candidate:
            places = (
                f"twice, differently, in {described(module)}"
                if first[1] == module
                else f"differently in {described(first[1])} and in {described(module)}"
            )
            raise _invalid(
                f"{where}: queue {candidate.name!r} is defined {places}; define it once and import it where it "
                "is used.",
                path=str(source.path),
                queue=candidate.name,
            )
        if candidate not in queues:
            queues.append(candidate)

    for name in module_names:
        module = _import_module(source, name, "tasks", plugin=(owners or {}).get(name))
        for attribute, value in list(vars(module).items()):
            if isinstance(value, TaskDefinition) and id(value) not in seen_tasks:
                if value.id in task_modules:  # another definition (the same one is seen once) has the id
                    places = (
                        f"twice in {described(name)}, as {task_names[value.id]} and as {attribute}"
                        if task_modules[value.id] == name
                        else f"by {described(task_modules[value.id])} and again by {described(name)}"
                    )
                    raise _invalid(
                        f"{where}: task id {value.id!r} is defined {places}; task ids must be unique.",
                        path=str(source.path),
                        task_id=value.id,
                    )
                task_modules[value.id] = name
                task_names[value.id] = attribute
                seen_tasks.add(id(value))
                tasks.append(value)
            elif isinstance(value, QueueDefinition):
                add_queue(value, name)
    for definition in tasks:
        if definition.queue is not None:
            add_queue(definition.queue, task_modules[definition.id])
    return queues, tasks
