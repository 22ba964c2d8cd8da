"""runlane.toml: discovery, ${VAR} expansion, strict validation, and building the runtime from it."""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from runlane import ErrorCode, Runlane, RunlaneError
from runlane.config import (
    ConfigSource,
    LoadedConfig,
    build_runtime,
    find_config,
    load_config,
    load_runtime,
    parse_config,
)
from runlane_local import local_lane

_counter = itertools.count()


@pytest.fixture(autouse=True)
def _isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Keep sys.path and the modules written by a test from leaking into the next one."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def unique(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}"


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> LoadedConfig:
    write(tmp_path / "runlane.toml", text)
    loaded = load_config(cwd=tmp_path, environ=environ or {})
    assert loaded is not None
    return loaded


def invalid(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        load(tmp_path, text, environ)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    return caught.value


class RecordingLaneFactory:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, use: str, options: dict[str, Any]) -> Any:
        self.calls.append((use, options))
        return local_lane()


TASKS_MODULE = """
    from runlane import queue, task

    emails = queue("emails", default=True)
    billing = queue("billing", concurrency_limit=2)

    @task("emails.welcome", queue=emails)
    async def welcome(payload: dict) -> None:
        pass

    @task("billing.charge", queue=billing)
    def charge(payload: dict) -> None:
        pass

    alias = welcome  # the same definition twice at module level is registered once
    not_a_task = "emails.welcome"
"""


# ---------------------------------------------------------------------------------------------
# Discovery


def test_runlane_toml_in_cwd_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "runlane.toml", '[lane]\nuse = "local"\n')
    monkeypatch.chdir(tmp_path)
    source = find_config()
    assert source is not None
    assert source.path == (tmp_path / "runlane.toml").resolve()
    assert source.path.is_absolute()
    assert source.table == {"lane": {"use": "local"}}
    assert not source.is_pyproject


def test_runlane_toml_wins_over_pyproject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "runlane.toml", '[lane]\nuse = "from-runlane-toml"\n')
    write(tmp_path / "pyproject.toml", '[tool.runlane.lane]\nuse = "from-pyproject"\n')
    monkeypatch.chdir(tmp_path)
    source = find_config()
    assert source is not None and source.path.name == "runlane.toml"
    assert source.table["lane"]["use"] == "from-runlane-toml"


def test_pyproject_tool_runlane_is_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        tmp_path / "pyproject.toml",
        """
        [project]
        name = "app"

        [tool.runlane.runlane]
        environment = "staging"

        [tool.runlane.lane]
        use = "local"
        """,
    )
    monkeypatch.chdir(tmp_path)
    source = find_config()
    assert source is not None
    assert source.path == (tmp_path / "pyproject.toml").resolve()
    assert source.is_pyproject
    assert source.table == {"runlane": {"environment": "staging"}, "lane": {"use": "local"}}
    loaded = parse_config(source, environ={})
    assert loaded.environment == "staging"


def test_pyproject_without_tool_runlane_is_not_a_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "pyproject.toml", '[project]\nname = "app"\n')
    monkeypatch.chdir(tmp_path)
    assert find_config() is None
    assert load_config() is None


def test_nothing_found_is_none(tmp_path: Path) -> None:
    assert find_config(cwd=tmp_path) is None


def test_explicit_path_wins_over_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "runlane.toml", '[lane]\nuse = "cwd"\n')
    write(tmp_path / "deploy" / "prod.toml", '[lane]\nuse = "explicit"\n')
    monkeypatch.chdir(tmp_path)
    source = find_config("deploy/prod.toml")
    assert source is not None
    assert source.path == (tmp_path / "deploy" / "prod.toml").resolve()
    assert source.table["lane"]["use"] == "explicit"
    assert source.base_dir == (tmp_path / "deploy").resolve()


def test_explicit_relative_path_resolves_against_given_cwd(tmp_path: Path) -> None:
    write(tmp_path / "elsewhere" / "runlane.toml", '[lane]\nuse = "local"\n')
    source = find_config("runlane.toml", cwd=tmp_path / "elsewhere")
    assert source is not None and source.path == (tmp_path / "elsewhere" / "runlane.toml").resolve()


def test_explicit_pyproject_reads_tool_runlane(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[tool.runlane.lane]\nuse = "local"\n')
    source = find_config(tmp_path / "pyproject.toml", cwd=tmp_path)
    assert source is not None and source.table == {"lane": {"use": "local"}}


def test_explicit_pyproject_without_tool_runlane_is_invalid(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[project]\nname = "app"\n')
    with pytest.raises(RunlaneError, match=r"no \[tool.runlane\] table") as caught:
        find_config(tmp_path / "pyproject.toml", cwd=tmp_path)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_missing_explicit_path_is_invalid(tmp_path: Path) -> None:
    write(tmp_path / "runlane.toml", '[lane]\nuse = "local"\n')  # present, but not what was asked for
    with pytest.raises(RunlaneError, match="missing.toml") as caught:
        find_config("missing.toml", cwd=tmp_path)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "does not exist" in caught.value.message


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    write(tmp_path / "runlane.toml", '[runlane]\nenvironment = "dev"\ntasks = [\n  "app.tasks"\n  "more"\n]\n')
    with pytest.raises(RunlaneError) as caught:
        find_config(cwd=tmp_path)
    error = caught.value
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert error.message.startswith("runlane.toml: invalid TOML")
    assert "line 5" in error.message
    assert error.meta["line"] == 5
    assert error.meta["path"] == str((tmp_path / "runlane.toml").resolve())


def test_a_config_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # Some Windows editors write one first; it was refused as "invalid TOML ... (at line 1, column 1)".
    for name, prefix in (("runlane.toml", ""), ("pyproject.toml", "tool.runlane.")):
        folder = tmp_path / name.split(".")[0]
        text = f'[{prefix}runlane]\nenvironment = "bom"\n[{prefix}lane]\nuse = "local"\n'
        folder.mkdir()
        (folder / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        loaded = load_config(cwd=folder, environ={})
        assert loaded is not None and loaded.environment == "bom"


def test_pyproject_syntax_error_is_invalid(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", "[tool.runlane\n")
    with pytest.raises(RunlaneError, match=r"pyproject.toml: invalid TOML.*line 1"):
        find_config(cwd=tmp_path)


# ---------------------------------------------------------------------------------------------
# ${VAR} expansion


def test_env_vars_expand_in_every_string(tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        """
        [runlane]
        environment = "${APP_ENV}"
        tasks = ["${TASKS_PKG}.tasks", "plain"]

        [lane]
        use = "postgres-polling"
        connection_string = "postgres://${DB_USER}@${DB_HOST:-localhost}/app"
        port = 5432
        nested = { list = ["${DB_USER}", 1, true] }

        [[exporters]]
        use = "console"
        consumer = "${CONSUMER:-local_console}"
        """,
        environ={"APP_ENV": "production", "TASKS_PKG": "app", "DB_USER": "ops"},
    )
    assert loaded.environment == "production"
    assert loaded.runlane.tasks == ["app.tasks", "plain"]
    assert loaded.lane is not None
    assert loaded.lane.options == {
        "connection_string": "postgres://ops@localhost/app",
        "port": 5432,
        "nested": {"list": ["ops", 1, True]},
    }
    assert loaded.exporters[0].consumer == "local_console"


def test_default_applies_to_empty_values_and_set_values_win(tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        """
        [lane]
        use = "local"
        a = "${EMPTY:-fallback}"
        b = "${SET:-fallback}"
        c = "${UNSET:-}"
        """,
        environ={"EMPTY": "", "SET": "real"},
    )
    assert loaded.lane is not None
    assert loaded.lane.options == {"a": "fallback", "b": "real", "c": ""}


def test_a_default_may_hold_references_of_its_own(tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        """
        [lane]
        use = "local"
        a = "${UNSET:-${SET}}"
        b = "${UNSET:-${ALSO_UNSET:-${SET}/deep}}"
        c = "${SET:-${NEVER_READ}}"
        d = "${UNSET:-x}}"
        """,
        environ={"SET": "real"},
    )
    assert loaded.lane is not None
    assert loaded.lane.options == {"a": "real", "b": "real/deep", "c": "real", "d": "x}"}
    with pytest.raises(RunlaneError) as raised:
        load(tmp_path, '[lane]\nuse = "local"\na = "${UNSET:-${MISSING}}"\n', environ={})
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID and "MISSING" in raised.value.message


def test_double_dollar_is_a_literal_dollar(tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        """
        [lane]
        use = "local"
        password = "pa$$word$${NOT_EXPANDED}"
        bare = "cost: $5"
        """,
    )
    assert loaded.lane is not None
    assert loaded.lane.options == {"password": "pa$word${NOT_EXPANDED}", "bare": "cost: $5"}


def test_unset_variable_names_variable_and_key(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "postgres-polling"\nconnection_string = "${DATABASE_URL}"\n')
    assert error.message.startswith("runlane.toml: [lane] connection_string:")
    assert "'DATABASE_URL' is not set" in error.message
    assert error.meta["variable"] == "DATABASE_URL"
    assert error.meta["key"] == "lane.connection_string"


def test_unset_variable_inside_exporters_names_the_entry(tmp_path: Path) -> None:
    error = invalid(
        tmp_path,
        """
        [lane]
        use = "local"

        [[exporters]]
        use = "console"
        consumer = "one"

        [[exporters]]
        use = "otel"
        consumer = "two"
        endpoints = ["${OTEL_ENDPOINT}"]
        """,
    )
    assert "[[exporters]] #2 endpoints[0]" in error.message
    assert error.meta["key"] == "exporters[1].endpoints[0]"


def test_unterminated_reference_is_invalid(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "local"\npath = "${DATA_DIR/runlane.db"\n')
    assert "closing '}'" in error.message


def test_invalid_reference_name_is_invalid(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "local"\npath = "${1BAD}"\n')
    assert "${1BAD}" in error.message


def test_os_environ_is_the_default_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLANE_TEST_CONFIG_ENV", "from-os")
    write(tmp_path / "runlane.toml", '[runlane]\nenvironment = "${RUNLANE_TEST_CONFIG_ENV}"\n[lane]\nuse = "local"\n')
    loaded = load_config(cwd=tmp_path)
    assert loaded is not None and loaded.environment == "from-os"


# ---------------------------------------------------------------------------------------------
# Validation


def test_example_file_is_valid(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "runlane.toml.example"
    loaded = load(tmp_path, example.read_text(encoding="utf-8"))
    assert loaded.environment == "development"
    assert loaded.runlane.tasks == ["app.tasks"]
    assert loaded.lane is not None and loaded.lane.use == "local" and loaded.lane.options == {}
    assert loaded.dev.tick_interval == "5s" and loaded.dev.tick_interval_ms == 5000
    assert [(e.use, e.consumer, e.options) for e in loaded.exporters] == [("console", "local_console", {})]


def test_defaults(tmp_path: Path) -> None:
    loaded = load(tmp_path, '[lane]\nuse = "local"\n')
    assert loaded.environment == "default"
    assert loaded.runlane.tasks == []
    assert loaded.runlane.runtime is None
    assert loaded.dev.tick_interval_ms == 5000
    assert loaded.exporters == []


def test_unknown_key_in_runlane_table_suggests_the_right_one(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\ntaks = ["app.tasks"]\n[lane]\nuse = "local"\n')
    assert error.message.startswith("runlane.toml: [runlane] unknown key 'taks' (did you mean 'tasks'?)")
    assert error.meta["table"] == "runlane" and error.meta["key"] == "taks"


def test_unknown_key_in_dev_table(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "local"\n[dev]\ntick_intervall = "1s"\n')
    assert "[dev] unknown key 'tick_intervall' (did you mean 'tick_interval'?)" in error.message


def test_unknown_table_suggests_the_right_one(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lanes]\nuse = "local"\n')
    assert error.message.startswith("runlane.toml: unknown table [lanes] (did you mean [lane]?)")


def test_unknown_key_without_a_close_match_lists_allowed_keys(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\nzzz = 1\n[lane]\nuse = "local"\n')
    assert "did you mean" not in error.message
    assert "allowed keys: environment, tasks, runtime" in error.message


def test_unknown_key_in_pyproject_names_the_tool_table(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[tool.runlane.runlane]\nenviroment = "x"\n[tool.runlane.lane]\nuse = "local"\n')
    with pytest.raises(RunlaneError) as caught:
        load_config(cwd=tmp_path, environ={})
    assert caught.value.message.startswith(
        "pyproject.toml: [tool.runlane.runlane] unknown key 'enviroment' (did you mean 'environment'?)"
    )


def test_lane_extra_keys_are_options_not_errors(tmp_path: Path) -> None:
    loaded = load(tmp_path, '[lane]\nuse = "sqlite"\npath = "runlane.db"\nbusy_timeout = "5s"\n')
    assert loaded.lane is not None
    assert loaded.lane.use == "sqlite"
    assert loaded.lane.options == {"path": "runlane.db", "busy_timeout": "5s"}


def test_lane_without_use_is_invalid(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\npath = "runlane.db"\n')
    assert "[lane] missing key 'use'" in error.message


def test_exporter_without_consumer_is_invalid(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "local"\n[[exporters]]\nuse = "console"\n')
    assert "[[exporters]] #1 missing key 'consumer'" in error.message


def test_exporter_consumers_are_ids_and_unique(tmp_path: Path) -> None:
    entry = '[[exporters]]\nuse = "console"\nconsumer = "{}"\n'
    error = invalid(tmp_path, '[lane]\nuse = "local"\n' + entry.format("audit:1"))
    assert error.message.endswith("[[exporters]] #1 key 'consumer': Invalid consumer 'audit:1': ':' is reserved; "
                                  "use '.', '_' or a hashed segment instead.")
    error = invalid(tmp_path, '[lane]\nuse = "local"\n' + entry.format("a") + entry.format("b") + entry.format("a"))
    assert "[[exporters]]: entries #1 and #3 share consumer 'a'; each exporter needs its own consumer name" in (
        error.message
    )


def test_exporter_options_are_collected(tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        '[lane]\nuse = "local"\n[[exporters]]\nuse = "otel"\nconsumer = "c"\nendpoint = "http://x"\n',
    )
    assert loaded.exporters[0].options == {"endpoint": "http://x"}


def test_wrong_types_name_table_and_key(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\ntasks = "app.tasks"\n[lane]\nuse = "local"\n')
    assert "[runlane] key 'tasks'" in error.message and "list" in error.message

    error = invalid(tmp_path, 'runlane = 3\n[lane]\nuse = "local"\n')
    assert "[runlane]" in error.message

    error = invalid(tmp_path, '[runlane]\nenvironment = 7\n[lane]\nuse = "local"\n')
    assert "[runlane] key 'environment'" in error.message


def test_a_table_written_as_a_value_says_to_write_it_as_a_table(tmp_path: Path) -> None:
    # pydantic's own text named a class of runlane's ("a valid dictionary or instance of LaneConfig").
    error = invalid(tmp_path, 'lane = "sqlite"\n')
    assert error.message == (
        "runlane.toml: [lane] must be a table, not a string: write [lane] on a line of its own, its keys below it."
    )
    error = invalid(tmp_path, 'dev = 5\n[lane]\nuse = "local"\n')
    assert "[dev] must be a table, not an integer" in error.message
    error = invalid(tmp_path, 'exporters = ["console"]\n[lane]\nuse = "local"\n')
    assert "[[exporters]] #1 must be a table, not a string" in error.message
    assert "instance of" not in error.message

    # [exporters] with one pair of brackets is one table, not the array of tables each entry belongs to.
    error = invalid(tmp_path, '[lane]\nuse = "local"\n[exporters]\nuse = "console"\nconsumer = "c"\n')
    assert "[[exporters]] must be an array of tables, not a table" in error.message
    assert "its own [[exporters]] header line (two brackets)" in error.message


def test_bad_tick_interval_is_invalid(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "local"\n[dev]\ntick_interval = "soon"\n')
    assert "[dev] key 'tick_interval'" in error.message and "'30s'" in error.message

    # A bare number has no unit: the message says what to write instead of "Input should be a valid string".
    error = invalid(tmp_path, '[lane]\nuse = "local"\n[dev]\ntick_interval = 5\n')
    assert "[dev] key 'tick_interval'" in error.message and 'a duration string such as "5s"' in error.message
    assert "valid string" not in error.message


def test_bad_module_names_are_invalid(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\ntasks = ["app/tasks.py"]\n[lane]\nuse = "local"\n')
    assert "[runlane] key 'tasks'" in error.message and "not a module name" in error.message

    error = invalid(tmp_path, '[runlane]\ntasks = "app.tasks"\n[lane]\nuse = "local"\n')
    assert "[runlane] key 'tasks'" in error.message and 'tasks = ["app.tasks"]' in error.message
    assert "valid list" not in error.message

    error = invalid(tmp_path, '[runlane]\nruntime = "app.runtime"\n')
    assert "'module:attribute'" in error.message


def test_runtime_excludes_tasks(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\nruntime = "app:rt"\ntasks = ["app.tasks"]\n')
    assert "[runlane] runtime excludes [runlane] tasks" in error.message


def test_runtime_excludes_lane(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\nruntime = "app:rt"\n[lane]\nuse = "local"\n')
    assert "runtime excludes [lane]" in error.message


def test_without_runtime_a_lane_is_required(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[runlane]\ntasks = ["app.tasks"]\n')
    assert "no [lane] table" in error.message


def test_config_source_can_be_built_in_memory() -> None:
    source = ConfigSource(path=Path("/nowhere/runlane.toml"), table={"lane": {"use": "local"}}, display="runlane.toml")
    loaded = parse_config(source, environ={})
    assert loaded.base_dir == Path("/nowhere")


# ---------------------------------------------------------------------------------------------
# Building the runtime from tasks + [lane]


def test_tasks_modules_register_their_tasks_and_queues(tmp_path: Path) -> None:
    package = unique("app")
    write(tmp_path / package / "__init__.py", "")
    write(tmp_path / package / "tasks.py", TASKS_MODULE)
    loaded = load(tmp_path, f'[runlane]\nenvironment = "dev"\ntasks = ["{package}.tasks"]\n[lane]\nuse = "local"\n')
    factory = RecordingLaneFactory()

    runtime = load_runtime(loaded, lane_factory=factory)

    assert isinstance(runtime, Runlane)
    assert runtime.environment.name == "dev"
    assert sorted(runtime.tasks) == ["billing.charge", "emails.welcome"]
    assert sorted(runtime.queues) == ["billing", "emails"]
    assert factory.calls == [("local", {})]


def test_queues_referenced_only_by_tasks_are_included(tmp_path: Path) -> None:
    package = unique("shared")
    write(
        tmp_path / package / "__init__.py",
        """
        from runlane import queue
        def _make():
            return queue("hidden", default=True)
        """,
    )
    write(
        tmp_path / package / "jobs.py",
        f"""
        from runlane import task
        from {package} import _make

        @task("jobs.one", queue=_make())
        def one() -> None:
            pass
        """,
    )
    loaded = load(tmp_path, f'[runlane]\ntasks = ["{package}.jobs"]\n[lane]\nuse = "local"\n')
    runtime = load_runtime(loaded, lane_factory=RecordingLaneFactory())
    assert list(runtime.queues) == ["hidden"]
    assert list(runtime.tasks) == ["jobs.one"]


def test_definitions_shared_between_modules_are_registered_once(tmp_path: Path) -> None:
    first, second = unique("first"), unique("second")
    write(tmp_path / f"{first}.py", TASKS_MODULE)
    write(
        tmp_path / f"{second}.py",
        f"""
        from runlane import task
        from {first} import emails, welcome

        @task("emails.goodbye", queue=emails)
        def goodbye(payload: dict) -> None:
            pass
        """,
    )
    loaded = load(tmp_path, f'[runlane]\ntasks = ["{first}", "{second}", "{first}"]\n[lane]\nuse = "local"\n')
    runtime = load_runtime(loaded, lane_factory=RecordingLaneFactory())
    assert sorted(runtime.tasks) == ["billing.charge", "emails.goodbye", "emails.welcome"]
    assert sorted(runtime.queues) == ["billing", "emails"]


def test_extra_task_modules_are_imported_too(tmp_path: Path) -> None:
    module = unique("plugin_tasks")
    write(tmp_path / f"{module}.py", TASKS_MODULE)
    loaded = load(tmp_path, '[lane]\nuse = "local"\n')
    runtime = load_runtime(loaded, lane_factory=RecordingLaneFactory(), task_modules=[module])
    assert sorted(runtime.tasks) == ["billing.charge", "emails.welcome"]


def runtime_refused(tmp_path: Path, *modules: str) -> str:
    """The message of the configuration_invalid a runtime over ``modules`` is refused with."""
    listed = ", ".join(f'"{module}"' for module in modules)
    loaded = load(tmp_path, f'[runlane]\ntasks = [{listed}]\n[lane]\nuse = "local"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=RecordingLaneFactory())
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    return caught.value.message


def test_a_task_id_or_queue_defined_twice_names_both_modules(tmp_path: Path) -> None:
    first, second = unique("first"), unique("second")
    write(tmp_path / f"{first}.py", TASKS_MODULE)
    write(
        tmp_path / f"{second}.py",
        """
        from runlane import queue, task

        emails = queue("emails", concurrency_limit=3)

        @task("emails.welcome", queue=emails)
        def welcome_again(payload: dict) -> None:
            pass
        """,
    )
    message = runtime_refused(tmp_path, first, second)
    assert f"queue 'emails' is defined differently in module {first!r} and in module {second!r}" in message

    third = unique("third")
    again = "from runlane import task\n\n@task('emails.welcome')\ndef again(p: dict) -> None:\n    pass\n"
    write(tmp_path / f"{third}.py", again)
    message = runtime_refused(tmp_path, first, third)
    assert f"task id 'emails.welcome' is defined by module {first!r} and again by module {third!r}" in message


def test_a_task_id_or_queue_defined_twice_in_one_module_names_the_module_once(tmp_path: Path) -> None:
    # "defined by module 'm' and again by module 'm'" named neither definition to look for.
    module = unique("twice")
    source = """
        from runlane import queue, task

        default = queue("default", default=True)

        @task("emails.welcome")
        def welcome(payload: dict) -> None:
            pass

        @task("emails.welcome")
        def welcome_copy(payload: dict) -> None:
            pass
        """
    write(tmp_path / f"{module}.py", source)
    message = runtime_refused(tmp_path, module)
    assert f"task id 'emails.welcome' is defined twice in module {module!r}, as welcome and as welcome_copy" in message

    queues = 'from runlane import queue\n\na = queue("a")\nb = queue("a", concurrency_limit=2)\n'
    write(tmp_path / f"{module}_queues.py", queues)
    message = runtime_refused(tmp_path, f"{module}_queues")
    assert f"queue 'a' is defined twice, differently, in module '{module}_queues';" in message


def test_task_modules_without_a_queue_are_named_with_what_to_add(tmp_path: Path) -> None:
    module = unique("queueless")
    source = 'from runlane import task\n\n@task("hello.greet")\ndef greet(payload: dict) -> None:\n    pass\n'
    write(tmp_path / f"{module}.py", source)
    message = runtime_refused(tmp_path, module)
    assert f"tasks ({module}) define no queue" in message and 'queue("default", default=True)' in message
    assert "create_runlane()" not in message


def test_a_plugin_task_module_that_fails_to_import_names_the_plugin(tmp_path: Path) -> None:
    loaded = load(tmp_path, '[lane]\nuse = "local"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=RecordingLaneFactory(), task_modules={"no_such_plugin_tasks": "acme"})
    message = caught.value.message
    assert message.startswith("plugin 'acme' registers task module 'no_such_plugin_tasks' (register_task_modules)")
    assert "[runlane] tasks" not in message and "leave it out of RUNLANE_LOAD_PLUGINS" in message


def test_lane_options_reach_the_factory_unchanged(tmp_path: Path) -> None:
    module = unique("tasks")
    write(tmp_path / f"{module}.py", TASKS_MODULE)
    loaded = load(
        tmp_path,
        f"""
        [runlane]
        tasks = ["{module}"]

        [lane]
        use = "postgres-polling"
        connection_string = "${{DATABASE_URL}}"
        schema = "runlane"
        pool = {{ min = 1, max = 4 }}
        hosts = ["a", "b"]
        """,
        environ={"DATABASE_URL": "postgres://db/app"},
    )
    factory = RecordingLaneFactory()
    load_runtime(loaded, lane_factory=factory)
    assert factory.calls == [
        (
            "postgres-polling",
            {
                "connection_string": "postgres://db/app",
                "schema": "runlane",
                "pool": {"min": 1, "max": 4},
                "hosts": ["a", "b"],
            },
        )
    ]


def test_config_directory_is_on_the_import_path_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    module = unique("tasks")
    write(project / f"{module}.py", TASKS_MODULE)
    write(project / "runlane.toml", f'[runlane]\ntasks = ["{module}"]\n[lane]\nuse = "local"\n')
    monkeypatch.chdir(tmp_path)  # the config is found explicitly, from another directory
    loaded = load_config("project/runlane.toml", environ={})
    assert loaded is not None
    load_runtime(loaded, lane_factory=RecordingLaneFactory())
    load_runtime(loaded, lane_factory=RecordingLaneFactory())
    assert sys.path.count(str(project.resolve())) == 1
    assert sys.path[0] == str(project.resolve())


async def test_async_lane_factory_is_awaited(tmp_path: Path) -> None:
    module = unique("tasks")
    write(tmp_path / f"{module}.py", TASKS_MODULE)
    loaded = load(tmp_path, f'[runlane]\ntasks = ["{module}"]\n[lane]\nuse = "local"\n')
    seen: list[str] = []

    async def factory(use: str, options: dict[str, Any]) -> Any:
        seen.append(use)
        return local_lane()

    runtime = await build_runtime(loaded, lane_factory=factory)
    assert isinstance(runtime, Runlane) and seen == ["local"]


def test_missing_tasks_module_names_module_and_error(tmp_path: Path) -> None:
    loaded = load(tmp_path, '[runlane]\ntasks = ["no_such_module_here.tasks"]\n[lane]\nuse = "local"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=RecordingLaneFactory())
    error = caught.value
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert "cannot import module 'no_such_module_here.tasks'" in error.message
    assert "ModuleNotFoundError" in error.message
    assert error.meta["module"] == "no_such_module_here.tasks"
    # The module is not where the config says: where Runlane looked (a config given with -c from elsewhere).
    assert f"modules are imported from the config file's directory ({tmp_path}) and the Python path" in error.message


def import_failure(tmp_path: Path, prefix: str, source: str) -> tuple[str, RunlaneError]:
    """Load a config whose one task module (a fresh name starting with ``prefix``) is ``source``, which
    cannot be imported: the module's name and the error."""
    module = unique(prefix)
    write(tmp_path / f"{module}.py", source)
    loaded = load(tmp_path, f'[runlane]\ntasks = ["{module}"]\n[lane]\nuse = "local"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=RecordingLaneFactory())
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert f"cannot import module '{module}'" in caught.value.message
    return module, caught.value


def test_a_module_missing_what_it_imports_is_not_reported_as_missing_itself(tmp_path: Path) -> None:
    _, error = import_failure(tmp_path, "imports_missing", "import no_such_dependency_here\n")
    assert "No module named 'no_such_dependency_here'" in error.message
    assert "imported from the config file's directory" not in error.message


def test_module_raising_on_import_names_the_underlying_error(tmp_path: Path) -> None:
    _, error = import_failure(tmp_path, "broken", 'raise RuntimeError("database not reachable at import time")\n')
    assert "RuntimeError: database not reachable at import time" in error.message
    assert isinstance(error.__cause__, RuntimeError)


def test_a_module_that_exits_as_it_is_imported_is_invalid_not_the_end_of_the_command(tmp_path: Path) -> None:
    # A script's entry point left outside `if __name__ == "__main__":` (sys.exit(), argparse) would
    # otherwise end `runlane trigger` with status 0 and no run.
    module, error = import_failure(tmp_path, "exits", "import sys\n\nsys.exit(0)\n")
    assert f"cannot import module '{module}': SystemExit: 0 (" in error.message
    assert error.meta["line"] == 3 and error.meta["file"].endswith(f"{module}.py")
    assert 'not under `if __name__ == "__main__":`' in error.message
    factory = unique("exiting_factory")
    write(tmp_path / f"{factory}.py", "import sys\n\n\ndef create():\n    sys.exit(2)\n")
    loaded = load(tmp_path, f'[runlane]\nruntime = "{factory}:create"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=unused_lane_factory)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert f"runtime factory '{factory}:create' failed: SystemExit: 2" in caught.value.message


def test_import_error_points_at_the_line_of_application_code_to_fix(tmp_path: Path) -> None:
    source = "from runlane import queue\n\nreports = queue('reports', concurrency_limit=0)\n"
    module, error = import_failure(tmp_path, "badqueue", source)
    # The check that refused the value lives in runlane; the line to fix is the caller's.
    assert error.message.endswith(f"{module}.py, line 3)"), error.message
    assert "expected a positive whole number, got 0" in error.message
    assert error.meta["line"] == 3 and error.meta["file"].endswith(f"{module}.py")


def test_module_with_syntax_error_is_invalid(tmp_path: Path) -> None:
    _, error = import_failure(tmp_path, "syntax", "def broken(:\n")
    assert "SyntaxError" in error.message


def test_a_syntax_error_in_a_module_the_task_module_imports_names_that_file_by_its_path(tmp_path: Path) -> None:
    # Python's own text names only the base name: "(tasks.py, line 2)" read as the task module itself.
    package, other = unique("syntax_app"), unique("syntax_billing")
    write(tmp_path / package / "__init__.py", "")
    write(tmp_path / package / "tasks.py", f"from {other} import tasks\n")
    write(tmp_path / other / "__init__.py", "")
    broken = write(tmp_path / other / "tasks.py", "x = 1\ny = (\n")
    loaded = load(tmp_path, f'[runlane]\ntasks = ["{package}.tasks"]\n[lane]\nuse = "local"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=RecordingLaneFactory())
    message = caught.value.message
    assert f"cannot import module '{package}.tasks': SyntaxError: '(' was never closed ({broken}, line 2)" in message
    assert "(tasks.py, line" not in message
    assert caught.value.meta["file"] == str(broken) and caught.value.meta["line"] == 2


# ---------------------------------------------------------------------------------------------
# Building the runtime from [runlane] runtime


RUNTIME_MODULE = """
    from runlane import create_runlane, queue, task
    from runlane_local import local_lane

    default = queue("default", default=True)

    @task("hello")
    def hello() -> None:
        pass

    def create_app_runlane():
        return create_runlane(lane=local_lane(), queues=[default], tasks=[hello], environment="app-env")

    async def create_async_runlane():
        return create_app_runlane()

    instance = create_app_runlane()

    class Holder:
        factory = staticmethod(create_app_runlane)

    def returns_wrong_thing():
        return {"not": "a runtime"}

    def explodes():
        raise ValueError("missing secret")

    async def explodes_async():
        raise ValueError("missing async secret")

    not_callable = 42
"""


def runtime_config(tmp_path: Path, attribute: str, extra: str = "") -> tuple[LoadedConfig, str]:
    module = unique("runtime_mod")
    write(tmp_path / f"{module}.py", RUNTIME_MODULE)
    return load(tmp_path, f'[runlane]\nruntime = "{module}:{attribute}"\n{extra}'), module


def unused_lane_factory(use: str, options: dict[str, Any]) -> Any:
    raise AssertionError("a runtime factory builds its own lane")


@pytest.mark.parametrize("attribute", ["create_app_runlane", "create_async_runlane", "instance", "Holder.factory"])
def test_runtime_factory_sync_async_or_instance(tmp_path: Path, attribute: str) -> None:
    loaded, _ = runtime_config(tmp_path, attribute)
    runtime = load_runtime(loaded, lane_factory=unused_lane_factory)
    assert isinstance(runtime, Runlane)
    assert runtime.environment.name == "app-env"
    assert list(runtime.tasks) == ["hello"]


@pytest.mark.parametrize("attribute", ["create_app_runlane", "create_async_runlane", "instance"])
async def test_build_runtime_awaits_inside_a_running_loop(tmp_path: Path, attribute: str) -> None:
    loaded, _ = runtime_config(tmp_path, attribute)
    runtime = await build_runtime(loaded, lane_factory=unused_lane_factory)
    assert isinstance(runtime, Runlane)


async def test_load_runtime_inside_a_running_loop_points_at_build_runtime(tmp_path: Path) -> None:
    loaded, _ = runtime_config(tmp_path, "create_async_runlane")
    with pytest.raises(RunlaneError, match="await build_runtime"):
        load_runtime(loaded, lane_factory=unused_lane_factory)


@pytest.mark.parametrize("attribute", ["create_app_runlane", "instance"])
async def test_plugin_observers_watch_a_runtime_from_a_factory_too(tmp_path: Path, attribute: str) -> None:
    seen: list[str] = []

    def observer(observation: Any) -> None:
        seen.append(observation.event_type.value)

    loaded, _ = runtime_config(tmp_path, attribute)
    runtime = await build_runtime(loaded, lane_factory=unused_lane_factory, observers=[observer])
    async with runtime:
        await runtime.trigger("hello")
        assert seen == ["run.created", "run.delivery_requested"]
        runtime.attach_observers([observer])  # attaching one again does not make it observe twice
        await runtime.trigger("hello")
    assert len(seen) == 4


def test_runtime_instance_is_returned_as_is(tmp_path: Path) -> None:
    loaded, module = runtime_config(tmp_path, "instance")
    runtime = load_runtime(loaded, lane_factory=unused_lane_factory)
    assert runtime is sys.modules[module].instance


def test_runtime_environment_mismatch_is_invalid(tmp_path: Path) -> None:
    loaded, _ = runtime_config(tmp_path, "create_app_runlane", 'environment = "other"\n')
    with pytest.raises(RunlaneError, match="'other' but the runtime"):
        load_runtime(loaded, lane_factory=unused_lane_factory)
    loaded, _ = runtime_config(tmp_path, "create_app_runlane", 'environment = "app-env"\n')
    assert load_runtime(loaded, lane_factory=unused_lane_factory).environment.name == "app-env"


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("prod\udcff", "it has a lone surrogate (bytes that are not UTF-8"),  # a variable holding Latin-1 bytes
        ("\u00e9" * 101, "longer than 200 bytes of UTF-8"),  # 101 characters, 202 bytes
        ("a\x00b", "it contains NUL"),
    ],
)
def test_an_environment_no_lane_can_store_is_refused_at_its_key(tmp_path: Path, value: str, problem: str) -> None:
    """The file's environment is checked like create_runlane's, and the error names the key it came from."""
    error = invalid(
        tmp_path,
        """
        [runlane]
        environment = "${RUNLANE_ENVIRONMENT}"
        tasks = []
        [lane]
        use = "local"
        """,
        {"RUNLANE_ENVIRONMENT": value},
    )
    assert "[runlane] key 'environment'" in error.message and problem in error.message
    assert "such as 'production'" in error.message


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [
        ("returns_wrong_thing", "returned dict, not a Runlane"),
        ("explodes", "failed: ValueError: missing secret"),
        ("explodes_async", "failed: ValueError: missing async secret"),
        ("not_callable", "neither a Runlane nor a factory"),
        ("no_such_attribute", "has no attribute 'no_such_attribute'"),
    ],
)
def test_bad_runtime_targets_are_invalid(tmp_path: Path, attribute: str, expected: str) -> None:
    loaded, _ = runtime_config(tmp_path, attribute)
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=unused_lane_factory)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert expected in caught.value.message


def test_runtime_module_import_error_is_invalid(tmp_path: Path) -> None:
    loaded = load(tmp_path, '[runlane]\nruntime = "no_such_runtime_module:create"\n')
    with pytest.raises(RunlaneError) as caught:
        load_runtime(loaded, lane_factory=unused_lane_factory)
    assert "cannot import module 'no_such_runtime_module'" in caught.value.message
    assert "ModuleNotFoundError" in caught.value.message


def test_runlane_keys_at_top_level_point_at_the_runlane_table(tmp_path: Path) -> None:
    error = invalid(tmp_path, 'tasks = ["app.tasks"]\n[lane]\nuse = "local"\n')
    assert "key 'tasks' belongs in the [runlane] table" in error.message


def test_misspelt_exporters_table_suggests_the_array_header(tmp_path: Path) -> None:
    error = invalid(tmp_path, '[lane]\nuse = "local"\n[[exporter]]\nuse = "console"\nconsumer = "c"\n')
    assert "unknown table [exporter] (did you mean [[exporters]]?)" in error.message
