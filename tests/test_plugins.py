"""The plugin system: hooks, the entry-point loader, registries and options validation.

Hook tests register a temporary plugin on the real manager with ``pm.register(...)`` and remove it in
``finally`` (the pattern documented in docs/plugin-hooks.md), so nothing leaks into other tests.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pluggy
import pytest
from pydantic import BaseModel, ConfigDict

import runlane.plugins
from runlane import ConsoleObservationSink, ErrorCode, RunlaneError
from runlane.core.lanes import Lane
from runlane.plugins import hookimpl, hookspecs, manager
from runlane.plugins.manager import get_plugins, get_registries, load_entry_point_plugins, load_plugins, pm
from runlane.plugins.registries import (
    ExporterProvider,
    LaneProvider,
    ProviderContext,
    StorageDriverProvider,
    TransportProvider,
    collect_registries,
    validate_options,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugin-hooks.md"


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PathOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    timeout_seconds: int = 5


def hook_names() -> list[str]:
    return sorted(name for name, value in vars(hookspecs).items() if hasattr(value, "runlane_spec"))


def new_manager() -> pluggy.PluginManager:
    fresh = pluggy.PluginManager("runlane")
    fresh.add_hookspecs(hookspecs)
    return fresh


class FakeEntryPoint:
    """Stands in for ``importlib.metadata.EntryPoint``: name, value, dist and ``load()``."""

    def __init__(self, name, plugin=None, *, error=None, distribution="runlane-fake", version="1.2.3"):
        self.name = name
        self.value = f"runlane_fake.{name}"
        self.group = "runlane"
        self.dist = SimpleNamespace(metadata={"Name": distribution}, version=version)
        self._plugin = plugin
        self._error = error
        self.loads = 0

    def load(self):
        self.loads += 1
        if self._error is not None:
            raise self._error
        return self._plugin


def lane_plugin(name: str) -> object:
    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider(name, NoOptions, lambda options, context: None))

    return Plugin()


# ---------------------------------------------------------------------------------------------
# One test per hook


def test_hook_register_lanes():
    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("test-lane", PathOptions, lambda options, context: ("lane", options.path)))

    pm.register(Plugin(), name="test-lanes")
    try:
        provider = get_registries().lanes.get("test-lane")
        assert provider.plugin == "test-lanes"
        options = validate_options(provider, {"path": "x.db"})
        assert provider.create(options, ProviderContext()) == ("lane", "x.db")
    finally:
        pm.unregister(name="test-lanes")
    assert "test-lane" not in get_registries().lanes


def test_hook_register_storage_drivers():
    class Plugin:
        @hookimpl
        def register_storage_drivers(self, register):
            register(StorageDriverProvider("test-storage", NoOptions, lambda options, context: "driver"))

    pm.register(Plugin(), name="test-storage")
    try:
        provider = get_registries().storage_drivers.get("test-storage")
        assert provider.plugin == "test-storage"
        assert provider.create(NoOptions(), ProviderContext()) == "driver"
    finally:
        pm.unregister(name="test-storage")


def test_hook_register_transports():
    class Plugin:
        @hookimpl
        def register_transports(self, register):
            register(TransportProvider("test-transport", NoOptions, lambda options, context: "transport"))

    pm.register(Plugin(), name="test-transports")
    try:
        registries = get_registries()
        assert registries.transports.names() == ["sqs", "test-transport"]
        assert registries.transports.get("test-transport").plugin == "test-transports"
    finally:
        pm.unregister(name="test-transports")


def test_hook_register_exporters():
    class Plugin:
        @hookimpl
        def register_exporters(self, register):
            register(ExporterProvider("test-exporter", NoOptions, lambda options, context: "sink"))

    pm.register(Plugin(), name="test-exporters")
    try:
        registries = get_registries()
        assert registries.exporters.get("test-exporter").plugin == "test-exporters"
        # core's own default plugin registers through the same hook
        console = registries.exporters.get("console")
        assert console.plugin == "runlane.plugins.defaults"
        assert isinstance(console.create(validate_options(console, {}), ProviderContext()), ConsoleObservationSink)
    finally:
        pm.unregister(name="test-exporters")


def test_hook_register_task_modules():
    class Plugin:
        @hookimpl
        def register_task_modules(self, register):
            register("app.tasks")
            register("app.tasks")

    pm.register(Plugin(), name="test-tasks")
    try:
        contributed = [(c.value, c.plugin) for c in get_registries().task_modules]
        assert contributed.count(("app.tasks", "test-tasks")) == 1
    finally:
        pm.unregister(name="test-tasks")


def test_hook_register_task_modules_rejects_non_module_names():
    class Plugin:
        @hookimpl
        def register_task_modules(self, register):
            register("app/tasks.py")

    with pytest.raises(RunlaneError) as raised:
        collect_registries(registered(Plugin(), "bad-tasks"))
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "bad-tasks" in raised.value.message


def test_hook_register_observers():
    def observer(observation):
        return None

    class Plugin:
        @hookimpl
        def register_observers(self, register):
            register(observer)

    pm.register(Plugin(), name="test-observers")
    try:
        registries = get_registries()
        assert [(c.value, c.plugin) for c in registries.observers if c.plugin == "test-observers"] == [
            (observer, "test-observers")
        ]
        assert registries.provided_by("test-observers") == {"observers": [observer.__qualname__]}
    finally:
        pm.unregister(name="test-observers")


def test_hook_register_commands():
    added = []

    class App:
        def command(self, name=None):
            def decorate(function):
                added.append(name or function.__name__)
                return function

            return decorate

    class Plugin:
        @hookimpl
        def register_commands(self, app):
            @app.command(name="hello")
            def hello():
                return "hi"

    pm.register(Plugin(), name="test-commands")
    try:
        pm.hook.register_commands(app=App())
        assert added == ["hello"]
    finally:
        pm.unregister(name="test-commands")


def registered(plugin, name: str) -> pluggy.PluginManager:
    fresh = new_manager()
    fresh.register(plugin, name=name)
    return fresh


# ---------------------------------------------------------------------------------------------
# Registries


def test_local_lane_is_found_through_its_entry_point():
    entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group="runlane")}
    assert entry_points["local"].value == "runlane_local.plugin"
    provider = get_registries().lanes.get("local")
    assert provider.plugin == "local"
    lane = provider.create(validate_options(provider, {"name": "dev"}), ProviderContext())
    assert isinstance(lane, Lane)
    assert lane.name == "dev"
    local = next(info for info in get_plugins() if info.name == "local")
    assert (local.distribution, local.version) == ("runlane-local", importlib.metadata.version("runlane-local"))
    assert local.provides == {"lanes": ["local", "sqlite"]}
    assert local.to_json()["hooks"] == ["register_lanes"]


def test_name_collision_names_both_plugins():
    fresh = new_manager()
    fresh.register(lane_plugin("shared"), name="first")
    fresh.register(lane_plugin("shared"), name="second")
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh)
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'first'" in raised.value.message and "'second'" in raised.value.message
    assert sorted(raised.value.meta["plugins"]) == ["first", "second"]


def test_unknown_lane_lists_installed_lanes():
    fresh = new_manager()
    fresh.register(lane_plugin("alpha"), name="a")
    fresh.register(lane_plugin("beta"), name="b")
    lanes = collect_registries(fresh).lanes
    with pytest.raises(RunlaneError) as raised:
        lanes.get("gamma")
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'gamma'" in raised.value.message
    assert "alpha" in raised.value.message and "beta" in raised.value.message
    assert raised.value.meta["installed"] == ["alpha", "beta"]


def test_unknown_first_party_lane_says_what_to_install():
    fresh = new_manager()
    fresh.register(lane_plugin("local"), name="local")  # runlane-postgres is not installed here
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh).lanes.get("postgres-polling")
    assert raised.value.message.endswith("Install runlane-postgres to get it.")
    assert raised.value.meta["installed"] == ["local"]


def test_every_name_a_first_party_plugin_registers_says_what_to_install_without_it():
    """A config naming any lane, storage driver, transport or exporter of runlane's own plugins, in an
    environment without that plugin's distribution, is told which distribution to install."""
    empty = collect_registries(new_manager())  # as with only runlane installed
    kinds = {
        "lanes": empty.lanes,
        "storage_drivers": empty.storage_drivers,
        "transports": empty.transports,
        "exporters": empty.exporters,
    }
    checked = []
    for plugin in get_plugins():
        if plugin.distribution in (None, "runlane") or not plugin.distribution.startswith("runlane-"):
            continue
        for kind, names in plugin.provides.items():
            for name in names if kind in kinds else ():
                with pytest.raises(RunlaneError) as raised:
                    kinds[kind].get(name)
                assert raised.value.message.endswith(f"Install {plugin.distribution} to get it."), (kind, name)
                checked.append(name)
    assert {"local", "sqlite", "postgres-polling", "postgres-sqs", "sqs", "otlp", "otlp-traces"} <= set(checked)


def test_an_installed_plugin_the_allowlist_leaves_out_is_named_as_such(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RUNLANE_LOAD_PLUGINS", "local")
    fresh = new_manager()
    fresh.register(lane_plugin("local"), name="local")
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh).lanes.get("postgres-polling")  # runlane-postgres is installed in this venv
    assert raised.value.message.endswith(
        "runlane-postgres is installed, but RUNLANE_LOAD_PLUGINS='local' does not load it; add runlane-postgres there."
    )
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh).exporters.get("nonesuch")
    assert "installed" in raised.value.message and "RUNLANE_LOAD_PLUGINS" not in raised.value.message


def test_first_party_plugins_provide_their_lanes_and_transport():
    registries = get_registries()
    assert {"local", "sqlite", "postgres-polling", "postgres-sqs"} <= set(registries.lanes.names())
    assert registries.lanes.get("postgres-sqs").plugin == "sqs"
    assert registries.transports.get("sqs").plugin == "sqs"


def test_misspelt_option_key_names_key_table_and_plugin():
    provider = get_registries().lanes.get("local")
    with pytest.raises(RunlaneError) as raised:
        validate_options(provider, {"nmae": "dev"})
    error = raised.value
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert "'nmae'" in error.message and "[lane]" in error.message and "'local'" in error.message
    assert error.meta["keys"] == ["nmae"]
    assert error.meta["plugin"] == "local"


def test_wrong_option_type_names_the_key():
    provider = LaneProvider("typed", PathOptions, lambda options, context: None, plugin="typed-plugin")
    with pytest.raises(RunlaneError) as raised:
        validate_options(provider, {"path": "x", "timeout_seconds": "soon"}, table="[lane]")
    assert "'timeout_seconds'" in raised.value.message
    assert "typed-plugin" in raised.value.message


def test_options_model_must_forbid_unknown_keys():
    class Loose(BaseModel):
        path: str = ""

    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("loose", Loose, lambda options, context: None))

    with pytest.raises(RunlaneError) as raised:
        collect_registries(registered(Plugin(), "loose-plugin"))
    assert "extra='forbid'" in raised.value.message and "loose-plugin" in raised.value.message


def test_wrong_provider_type_is_rejected():
    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(ExporterProvider("mixed", NoOptions, lambda options, context: None))

    with pytest.raises(RunlaneError) as raised:
        collect_registries(registered(Plugin(), "mixed-plugin"))
    assert "LaneProvider" in raised.value.message


def test_a_wrong_provider_type_is_named_with_its_article():
    class Plugin:
        @hookimpl
        def register_exporters(self, register):
            register({"name": "file"})

    with pytest.raises(RunlaneError) as raised:
        collect_registries(registered(Plugin(), "dict-plugin"))
    assert raised.value.message == (
        "Plugin 'dict-plugin' registered {'name': 'file'} as an exporter; "
        "pass an ExporterProvider(name, options_model, create)."
    )


def test_failing_register_hook_names_the_plugin():
    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            raise KeyError("boom")

    with pytest.raises(RunlaneError) as raised:
        collect_registries(registered(Plugin(), "boom-plugin"))
    assert "boom-plugin" in raised.value.message and "register_lanes" in raised.value.message


# ---------------------------------------------------------------------------------------------
# Loading


def test_allowlist_matches_entry_point_or_distribution_names(monkeypatch):
    monkeypatch.setenv("RUNLANE_LOAD_PLUGINS", " alpha , runlane_other ")
    allowlist = manager.plugin_allowlist()
    fresh = new_manager()
    entry_points = [
        FakeEntryPoint("alpha", lane_plugin("a")),
        FakeEntryPoint("beta", lane_plugin("b"), distribution="runlane-other"),
        FakeEntryPoint("gamma", lane_plugin("c"), distribution="runlane-gamma"),
    ]
    assert load_entry_point_plugins(fresh, entry_points, allowlist=allowlist) == ["alpha", "beta"]
    assert entry_points[2].loads == 0


def test_an_allowlist_entry_naming_nothing_installed_is_reported(monkeypatch, capsys):
    monkeypatch.setenv("RUNLANE_LOAD_PLUGINS", "alpha,alhpa")
    left_out: list[str] = []
    entry_points = [FakeEntryPoint("alpha", lane_plugin("a")), FakeEntryPoint("beta", lane_plugin("b"))]
    loaded = load_entry_point_plugins(
        new_manager(), entry_points, allowlist=manager.plugin_allowlist(), left_out=left_out
    )
    assert loaded == ["alpha"] and left_out == ["beta"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("runlane: RUNLANE_LOAD_PLUGINS names 'alhpa', but no installed plugin")


def test_a_name_only_a_left_out_plugin_could_provide_names_the_left_out_plugins(monkeypatch):
    monkeypatch.setenv("RUNLANE_LOAD_PLUGINS", "local")
    monkeypatch.setattr(manager, "_left_out", ["dictstore"])
    fresh = new_manager()
    fresh.register(lane_plugin("local"), name="local")
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh).lanes.get("dict")
    assert raised.value.message.endswith(
        "RUNLANE_LOAD_PLUGINS='local' leaves out the installed plugins 'dictstore'; add the one that provides it."
    )


def test_allowlist_set_but_empty_loads_none(monkeypatch):
    monkeypatch.setenv("RUNLANE_LOAD_PLUGINS", "")
    assert manager.plugin_allowlist() == frozenset()
    entry_point = FakeEntryPoint("alpha", lane_plugin("a"))
    fresh = new_manager()
    assert load_entry_point_plugins(fresh, [entry_point], allowlist=manager.plugin_allowlist()) == []
    assert entry_point.loads == 0


def test_allowlist_unset_loads_all(monkeypatch):
    monkeypatch.delenv("RUNLANE_LOAD_PLUGINS", raising=False)
    assert manager.plugin_allowlist() is None


def test_broken_plugin_is_reported_on_stderr_and_skipped(capsys):
    fresh = new_manager()
    entry_points = [
        FakeEntryPoint("broken", error=ImportError("No module named 'runlane_fake'")),
        FakeEntryPoint("healthy", lane_plugin("healthy")),
    ]
    assert load_entry_point_plugins(fresh, entry_points) == ["healthy"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "'broken'" in lines[0] and "runlane-fake" in lines[0] and "No module named 'runlane_fake'" in lines[0]
    assert not fresh.has_plugin("broken")
    assert collect_registries(fresh).lanes.names() == ["healthy"]
    assert any(failure.name == "broken" for failure in manager.get_plugin_failures())


def test_plugin_with_invalid_hookimpl_is_reported_and_skipped(capsys):
    class Plugin:
        @hookimpl
        def register_lanes(self, register, unexpected):
            pass

    fresh = new_manager()
    assert load_entry_point_plugins(fresh, [FakeEntryPoint("odd", Plugin())]) == []
    assert "'odd'" in capsys.readouterr().err


def test_load_plugins_is_idempotent(monkeypatch):
    load_plugins()
    before = [name for name, _ in pm.list_name_plugin()]

    def must_not_be_called():
        raise AssertionError("load_plugins() read entry points twice")

    monkeypatch.setattr(manager, "runlane_entry_points", must_not_be_called)
    load_plugins()
    assert [name for name, _ in pm.list_name_plugin()] == before
    assert "local" in before and "runlane.plugins.defaults" in before


def test_registration_hooks_run_once_while_the_registered_plugins_stay_the_same():
    calls: list[str] = []

    class Counted:
        @hookimpl
        def register_lanes(self, register):
            calls.append("lanes")
            register(LaneProvider("counted-lane", NoOptions, lambda options, context: None))

    class Other:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("other-lane", NoOptions, lambda options, context: None))

    pm.register(Counted(), name="counted")
    try:
        first = get_registries()
        assert get_registries() is first and get_plugins() and get_registries() is first
        assert calls == ["lanes"]
        pm.register(Other(), name="other")
        try:
            assert "other-lane" in get_registries().lanes  # a plugin registered since: collected again
            assert calls == ["lanes", "lanes"]
        finally:
            pm.unregister(name="other")
        assert "other-lane" not in get_registries().lanes
    finally:
        pm.unregister(name="counted")
    assert "counted-lane" not in get_registries().lanes


def test_a_command_of_a_first_party_plugin_that_is_not_loaded_says_what_to_do(tmp_path: Path):
    env = {**os.environ, "RUNLANE_LOAD_PLUGINS": "local"}
    for args in (["postgres", "migrate"], ["--json", "sqs", "consume"]):
        result = subprocess.run(
            [sys.executable, "-m", "runlane", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2, result.stderr  # a usage error, as for any unknown command
        distribution = f"runlane-{args[-2]}"
        assert (
            f"No such command {args[-2]!r}. {distribution} is installed, but RUNLANE_LOAD_PLUGINS='local' does not "
            f"load it; add {distribution} there."
        ) in " ".join(result.stderr.split()), result.stderr
        assert "Traceback" not in result.stderr
    command = [sys.executable, "-m", "runlane", "postgress"]
    unknown = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "No such command 'postgress'." in unknown.stderr
    assert "install" not in unknown.stderr.lower()


def _installed_plugin(site: Path, name: str, source: str) -> None:
    """An installed distribution ``runlane-NAME`` whose ``runlane`` entry point ``NAME`` is module
    ``runlane_NAME`` (with ``source``), in ``site`` (put it on PYTHONPATH)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"runlane_{name}.py").write_text(source)
    info = site / f"runlane_{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: runlane-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[runlane]\n{name} = runlane_{name}\n")


def test_a_cli_command_runs_an_installed_plugins_registration_hooks_once(tmp_path: Path):
    site = tmp_path / "site"
    _installed_plugin(
        site,
        "counted",
        "import os\n"
        "from runlane.plugins import hookimpl\n\n\n"
        "@hookimpl\n"
        "def register_lanes(register):\n"
        "    with open(os.environ['COUNTED_LOG'], 'a') as log:\n"
        "        log.write('lanes\\n')\n"
    )
    log = tmp_path / "calls.log"
    (tmp_path / "app.py").write_text('from runlane import queue\n\ndefault = queue("default", default=True)\n')
    (tmp_path / "runlane.toml").write_text('[runlane]\ntasks = ["app"]\n\n[lane]\nuse = "sqlite"\npath = "runs.db"\n')
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{tmp_path}", "COUNTED_LOG": str(log)}
    env.pop("RUNLANE_LOAD_PLUGINS", None)
    for command in (["runs", "list"], ["tick"]):
        log.unlink(missing_ok=True)
        result = subprocess.run(
            [sys.executable, "-m", "runlane", *command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert log.read_text().splitlines() == ["lanes"], command


def test_loading_the_same_entry_point_twice_registers_it_once():
    fresh = new_manager()
    entry_point = FakeEntryPoint("once", lane_plugin("once"))
    assert load_entry_point_plugins(fresh, [entry_point]) == ["once"]
    assert load_entry_point_plugins(fresh, [entry_point]) == []
    assert entry_point.loads == 1


def test_default_plugins_are_registered_on_the_manager():
    for module_name in manager.DEFAULT_PLUGINS:
        assert pm.has_plugin(module_name)


def test_hookimpl_marker_is_reexported():
    assert runlane.plugins.hookimpl is hookspecs.hookimpl
    assert hookspecs.hookimpl.project_name == "runlane"


# ---------------------------------------------------------------------------------------------
# Every hook is tested and documented


def test_every_hook_has_a_test():
    tests = {name for name in globals() if name.startswith("test_hook_")}
    assert hook_names(), "no hooks found in hookspecs.py"
    missing = [name for name in hook_names() if f"test_hook_{name}" not in tests]
    assert missing == []


def test_every_hook_is_documented_with_its_exact_signature():
    headings = set(re.findall(r"^#+ `([^`]+)`\s*$", DOCS.read_text(encoding="utf-8"), flags=re.MULTILINE))
    for name in hook_names():
        function = getattr(hookspecs, name)
        signature = f"{name}({', '.join(inspect.signature(function).parameters)})"
        assert signature in headings, f"docs/plugin-hooks.md has no heading `{signature}`"
        assert function.__doc__ and ":param" in function.__doc__, f"{name} needs a docstring with :param: lines"


def test_an_installed_plugin_whose_registration_fails_is_reported_and_skipped(capsys):
    class Failing:
        @hookimpl
        def register_lanes(self, register):
            raise RuntimeError("the plugin's own bug")

        @hookimpl
        def register_commands(self, app):
            app.command("never")(lambda: None)

    pm.register(Failing(), name="failing-plugin")
    try:
        registries = get_registries()
        assert registries.lanes.get("local").plugin == "local"  # everything else still works
        assert not pm.has_plugin("failing-plugin")  # skipped entirely, commands included
        err = capsys.readouterr().err
        assert "skipped plugin 'failing-plugin'" in err and "the plugin's own bug" in err
        assert any(failure.name == "failing-plugin" for failure in manager.get_plugin_failures())
        assert all(info.name != "failing-plugin" for info in get_plugins())
    finally:
        if pm.has_plugin("failing-plugin"):
            pm.unregister(name="failing-plugin")


def test_plugin_commands_that_break_or_shadow_runlane_commands_are_skipped_and_the_cli_starts(capsys):
    import typer
    import typer.main

    from runlane.cli.main import build_app

    class Raising:
        @hookimpl
        def register_commands(self, app):
            raise RuntimeError("command hook exploded")

    class BrokenElsewhere:  # its lanes hook fails: none of its commands may appear either
        @hookimpl
        def register_lanes(self, register):
            raise RuntimeError("lane hook exploded")

        @hookimpl
        def register_commands(self, app):
            app.command("ghost")(lambda: None)

    class Shadowing:
        @hookimpl
        def register_commands(self, app):
            fake = typer.Typer()
            fake.command("list")(lambda: print("shadowed"))
            app.add_typer(fake, name="runs")
            app.command("extra-from-shadowing")(lambda: None)

    class Healthy:
        @hookimpl
        def register_commands(self, app):
            app.command("hello")(lambda: print("hi"))

    class Rooting:  # app.callback() on the root replaced runlane's: -c, --json and --version were gone
        @hookimpl
        def register_commands(self, app):
            app.callback()(lambda verbose=False: None)
            app.command("extra-from-rooting")(lambda: None)

    plugins = {
        "raising": Raising(),
        "broken-elsewhere": BrokenElsewhere(),
        "shadowing": Shadowing(),
        "rooting": Rooting(),
        "healthy": Healthy(),
    }
    for name, plugin in plugins.items():
        pm.register(plugin, name=name)
    try:
        app = build_app()
        commands = typer.main.get_group(app).commands
        assert "hello" in commands and "ghost" not in commands and "extra-from-shadowing" not in commands
        assert {"get", "list", "attempts"} <= set(commands["runs"].commands)  # still runlane's own runs group
        err = capsys.readouterr().err
        assert "skipped plugin 'raising'" in err
        assert "register_commands raised RuntimeError: command hook exploded" in err
        assert "skipped plugin 'broken-elsewhere'" in err and "lane hook exploded" in err
        assert "skipped plugin 'shadowing'" in err and "its command 'runs' is already a runlane command" in err
        assert "skipped plugin 'rooting'" in err and "set the callback of the runlane command itself" in err
        assert "extra-from-rooting" not in commands
        root_options = {option for param in typer.main.get_group(app).params for option in param.opts}
        assert {"-c", "--json", "--version"} <= root_options
        assert [name for name in plugins if pm.has_plugin(name)] == ["healthy"]
    finally:
        for name in plugins:
            if pm.has_plugin(name):
                pm.unregister(name=name)


def test_plugin_commands_typer_cannot_build_skip_their_plugin_and_a_name_two_plugins_add_goes_to_neither(capsys):
    import click
    import typer
    import typer.main

    from runlane.cli.main import build_app

    class Unresolvable:  # an annotation only imported under TYPE_CHECKING, as with `from __future__ import annotations`
        @hookimpl
        def register_commands(self, app):
            def report(out: "NotImported") -> None:  # noqa: F821
                pass

            app.command("report")(report)

    class ClickGroup:
        @hookimpl
        def register_commands(self, app):
            app.add_typer(click.Group("clicky"), name="clicky")

    class ClickCommand:
        @hookimpl
        def register_commands(self, app):
            app.command("clicked")(click.Command("clicked", callback=lambda: None))

    def tools(word: str):
        class Tools:
            @hookimpl
            def register_commands(self, app):
                sub = typer.Typer()
                sub.command("hello")(lambda: print(word))
                app.add_typer(sub, name="tools")
                app.command(f"{word}-only")(lambda: print(word))
                nameless = typer.Typer()  # its commands join the root: only the shared one goes
                nameless.command("greet")(lambda: print(word))
                nameless.command(f"{word}-greets-too")(lambda: print(word))
                app.add_typer(nameless)

        return Tools()

    plugins = {
        "unresolvable": Unresolvable(),
        "click-group": ClickGroup(),
        "click-command": ClickCommand(),
        "alpha": tools("alpha"),
        "beta": tools("beta"),
    }
    for name, plugin in plugins.items():
        pm.register(plugin, name=name)
    try:
        app = build_app()
        commands = typer.main.get_group(app).commands  # the whole CLI builds
        assert "report" not in commands and "clicky" not in commands
        assert "tools" not in commands and {"alpha-only", "beta-only"} <= set(commands)
        assert "greet" not in commands and {"alpha-greets-too", "beta-greets-too"} <= set(commands)
        err = capsys.readouterr().err
        assert "skipped plugin 'unresolvable'" in err and "NotImported" in err
        assert "skipped plugin 'click-group'" in err and "clicked" not in commands
        # Said as the mistake it is, not as the AttributeError or NameError Typer fails with.
        assert (
            "its register_commands passed click.core.Group to app.add_typer(...), which takes a typer.Typer "
            "(never a Click object)" in err
        )
        assert (
            "skipped plugin 'click-command': its register_commands passed click.core.Command to app.command(), "
            "which takes a function (never a Click object)" in err
        )
        assert "the command 'tools' is added by plugins 'alpha' and 'beta'; it is added by neither" in err
        assert pm.has_plugin("alpha") and pm.has_plugin("beta")  # their other commands and providers stay
    finally:
        for name in plugins:
            if pm.has_plugin(name):
                pm.unregister(name=name)


def test_a_runlane_error_from_a_plugin_command_is_printed_with_its_code(capsys):
    from typer.testing import CliRunner

    from runlane.cli.main import build_app

    class Failing:
        @hookimpl
        def register_commands(self, app):
            @app.command("fail-politely")
            def fail() -> None:
                raise RunlaneError(ErrorCode.VALIDATION_FAILED, "The plugin says no.")

    pm.register(Failing(), name="failing-command")
    try:
        app = build_app()
        plain = CliRunner().invoke(app, ["fail-politely"])
        assert plain.exit_code == 1 and plain.exception is None or isinstance(plain.exception, SystemExit)
        assert "error[validation_failed]: The plugin says no." in plain.output
        as_json = CliRunner().invoke(app, ["--json", "fail-politely"])
        assert as_json.exit_code == 1 and '"code":"validation_failed"' in as_json.output.replace(" ", "")
        assert "Traceback" not in plain.output + as_json.output
    finally:
        if pm.has_plugin("failing-command"):
            pm.unregister(name="failing-command")


def test_a_name_two_installed_plugins_register_fails_only_where_it_is_used():
    pm.register(lane_plugin("shared"), name="first")
    pm.register(lane_plugin("shared"), name="second")
    try:
        registries = get_registries()
        assert registries.lanes.get("local").plugin == "local"
        with pytest.raises(RunlaneError) as raised:
            registries.lanes.get("shared")
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert sorted(raised.value.meta["plugins"]) == ["first", "second"]
        assert sorted(registries.lanes.collisions["shared"]) == ["first", "second"]
        provides = {info.name: info.provides for info in get_plugins()}
        assert provides["first"] == provides["second"] == {"lanes": ["shared"]}
    finally:
        pm.unregister(name="first")
        pm.unregister(name="second")


def test_a_plugin_that_exits_while_importing_is_skipped(capsys):
    fresh = new_manager()
    entry_points = [FakeEntryPoint("exits", error=SystemExit(3)), FakeEntryPoint("healthy", lane_plugin("healthy"))]
    assert load_entry_point_plugins(fresh, entry_points) == ["healthy"]
    assert "skipped plugin 'exits'" in capsys.readouterr().err

    class WrongHookArguments:  # pluggy refuses it with a message of several lines
        @hookimpl
        def register_lanes(self, regster):
            pass

    assert load_entry_point_plugins(fresh, [FakeEntryPoint("wrong", WrongHookArguments())]) == []
    (line,) = capsys.readouterr().err.splitlines()  # reported in one line
    assert line.startswith("runlane: skipped plugin 'wrong'") and "PluginValidationError" in line


def _explode(options, context):
    raise ValueError("no credentials in the environment")


async def _not_a_lane_later(options, context):
    return {"not": "a lane"}


@pytest.mark.parametrize(
    ("lane_create", "sink_create", "lane_says", "sink_says"),
    [
        (_explode, _explode, *2 * ["failed to start: ValueError: no credentials in the environment"]),
        (
            lambda options, context: {"not": "a lane"},
            lambda options, context: object(),
            "failed to start: its create() returned dict, not a Lane",
            "failed to start: its create() returned object, not a sink with export(records)",
        ),
        (_not_a_lane_later, _explode, "failed to start: its create() returned dict, not a Lane", "ValueError"),
    ],
    ids=["raises", "wrong-type", "async-wrong-type"],
)
def test_a_provider_whose_create_fails_is_a_configuration_error_naming_its_plugin(
    tmp_path: Path, lane_create: Any, sink_create: Any, lane_says: str, sink_says: str
):
    from runlane.cli.main import _lane_factory, configured_exporters
    from runlane.config import load_config
    from runlane.plugins.registries import collect_registries

    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("fragile", NoOptions, lane_create))

        @hookimpl
        def register_exporters(self, register):
            register(ExporterProvider("fragile", NoOptions, sink_create))

    fresh = new_manager()
    fresh.register(Plugin(), name="fragile-plugin")
    registries = collect_registries(fresh)
    config_file = tmp_path / "runlane.toml"
    config_file.write_text('[lane]\nuse = "fragile"\n[[exporters]]\nuse = "fragile"\nconsumer = "c"\n')
    config = load_config(config_file)

    def lane() -> Any:
        created = _lane_factory(config, registries)("fragile", {})
        return asyncio.run(created) if inspect.isawaitable(created) else created

    for build, says in ((lane, lane_says), (lambda: configured_exporters(config, registries), sink_says)):
        with pytest.raises(RunlaneError) as raised:
            build()
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert "of plugin 'fragile-plugin' " in raised.value.message and says in raised.value.message


def test_a_hook_that_returns_its_providers_instead_of_registering_them_is_reported():
    from runlane.plugins.registries import collect_registries

    class Returning:
        @hookimpl
        def register_lanes(self, register):
            return [LaneProvider("returned", NoOptions, lambda options, context: None)]

    fresh = new_manager()
    fresh.register(Returning(), name="returning-plugin")
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh)
    assert raised.value.meta["plugin"] == "returning-plugin"
    assert "register_lanes returned" in raised.value.message and "call register(provider)" in raised.value.message


def test_an_entry_point_naming_a_plugin_class_asks_for_an_instance(capsys):
    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            pass

    fresh = new_manager()
    assert load_entry_point_plugins(fresh, [FakeEntryPoint("classy", Plugin)]) == []
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("runlane: skipped plugin 'classy'") and "an instance" in line


_COMMAND_PLUGIN = '''
import typer

from runlane.cli.main import with_runtime  # at module top, as docs/plugin-hooks.md shows
from runlane.plugins import hookimpl
from runlane.plugins.manager import get_registries

get_registries()  # a plugin may ask for the registries while plugins are still loading


@hookimpl
def register_commands(app: typer.Typer) -> None:
    @app.command("backlog")
    def backlog(ctx: typer.Context) -> None:
        """Count the backlog."""
        with_runtime(ctx, lambda runtime: None)
'''


def test_a_plugin_importing_the_cli_helpers_at_module_top_loads_without_hanging(tmp_path: Path) -> None:
    # An installed distribution whose entry point imports runlane.cli.main while plugins load.
    _installed_plugin(tmp_path, "backlog", _COMMAND_PLUGIN)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    environment.pop("RUNLANE_LOAD_PLUGINS", None)
    script = (
        "from runlane.plugins.manager import get_plugins, get_registries\n"
        "get_registries()\n"
        "print([info.name for info in get_plugins() if info.name == 'backlog'])\n"
        "from typer.testing import CliRunner\n"
        "from runlane.cli.main import app\n"
        "print(CliRunner().invoke(app, ['backlog', '--help']).output.splitlines()[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['backlog']", "Usage: runlane backlog [OPTIONS]"], result.stdout


_GRABBING_PLUGINS = {
    # Adds a command to runlane's app at import, while the other plugins are still loading.
    "grabber": "from runlane.cli.main import app\n\n\n@app.command('grabbed')\ndef grabbed() -> None:\n    pass\n",
    # Reaches for runlane's app from its hook instead of using the app the hook receives.
    "hooked": (
        "from runlane.plugins import hookimpl\n\n\n@hookimpl\ndef register_commands() -> None:\n"
        "    from runlane.cli.main import app\n\n    app.command('hooked')(lambda: None)\n"
    ),
}


def test_a_plugin_reaching_for_the_cli_app_while_plugins_load_is_skipped_saying_what_to_do(tmp_path: Path) -> None:
    # The app was built then from the plugins loaded so far: the command line of `runlane` lost the grabbed
    # command silently (the build under way replaced that app), a program's `runlane.cli.main.app` lacked the
    # commands of every plugin loaded later (runlane-postgres's: "Install runlane-postgres to get it"), and a
    # hook that reached for it built the app again from itself until a RecursionError.
    for name, source in _GRABBING_PLUGINS.items():
        _installed_plugin(tmp_path, name, source)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    environment.pop("RUNLANE_LOAD_PLUGINS", None)
    script = (
        "import json, sys, typer\n"
        "from runlane.plugins.manager import get_plugins\n"
        "if sys.argv[1] == 'program':\n"
        "    get_plugins()\n"
        "    from runlane.cli.main import app\n"
        "    print(json.dumps(sorted(typer.main.get_group(app).commands)))\n"
        "else:\n"
        "    from runlane.cli.main import run\n"
        "    sys.argv[1:] = ['grabbed']\n"
        "    run()\n"
    )
    expected = "RuntimeError: runlane.cli.main.app is not built until every plugin has loaded and added its commands; "
    for how in ("program", "command line"):
        result = subprocess.run(
            [sys.executable, "-c", script, how],
            env=environment, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        skipped = [line for line in result.stderr.splitlines() if line.startswith("runlane: skipped plugin")]
        assert len(skipped) == 2 and all(expected in line for line in skipped), result.stderr
        assert "RecursionError" not in result.stderr
        if how == "program":
            assert result.returncode == 0, result.stderr
            commands = json.loads(result.stdout)
            assert "grabbed" not in commands and "hooked" not in commands and "plugins" in commands
            if "postgres" in {info.name for info in get_plugins()}:
                assert "postgres" in commands  # a plugin loaded after the grabber
        else:
            assert result.returncode == 2 and "No such command 'grabbed'" in result.stderr


def test_plugins_list_shows_the_commands_of_every_register_commands_a_plugin_implements():
    """A plugin may implement a hook twice (pluggy's ``specname``); the listing used to show only the commands
    of the implementation it read last."""
    import json

    from typer.testing import CliRunner

    from runlane.cli.main import build_app

    class Twice:
        @hookimpl
        def register_commands(self, app):
            app.command("twice-first")(lambda: None)

        @hookimpl(specname="register_commands")
        def register_more_commands(self, app):
            app.command("twice-second")(lambda: None)

    pm.register(Twice(), name="twice")
    try:
        result = CliRunner().invoke(build_app(), ["--json", "plugins", "list"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        (listed,) = [plugin for plugin in document["plugins"] if plugin["name"] == "twice"]
        assert listed["provides"]["commands"] == ["twice-first", "twice-second"]
    finally:
        if pm.has_plugin("twice"):
            pm.unregister(name="twice")
