"""How runlane reports a third-party plugin's mistakes: a taken entry-point name, a misspelt hook, a
``sys.exit()`` in a hook or provider, a ``register_commands`` taking no ``app``, a plugin command that
raises, and a name one plugin registers twice.

Entry points are real ``importlib.metadata`` ones, read from a ``.dist-info`` directory written to
``tmp_path``; plugins registered on the real manager are unregistered in ``finally``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest
import typer
from cli_support import cli, write
from pydantic import BaseModel, ConfigDict, field_validator
from typer.testing import CliRunner

from runlane import ErrorCode, RunlaneError
from runlane.plugins import hookimpl, hookspecs, manager
from runlane.plugins.manager import get_plugin_failures, get_plugins, load_entry_point_plugins, pm
from runlane.plugins.registries import LaneProvider, collect_registries


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


def new_manager() -> pluggy.PluginManager:
    fresh = pluggy.PluginManager("runlane")
    fresh.add_hookspecs(hookspecs)
    return fresh


def install(
    site: Path, distribution: str, entry_points: dict[str, str], modules: dict[str, str], requires: tuple[str, ...] = ()
) -> list[Any]:
    """Write ``distribution`` (its modules and a ``.dist-info`` declaring ``entry_points`` in the ``runlane``
    group and ``requires`` as its ``Requires-Dist`` lines) into ``site``; returns its entry points as
    ``importlib.metadata`` reads them."""
    for module, source in modules.items():
        write(site / f"{module}.py", source)
    info = site / f"{distribution.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    requires_dist = "".join(f"Requires-Dist: {line}\n" for line in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n{requires_dist}")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[runlane]\n{lines}")
    (dist,) = importlib.metadata.distributions(path=[str(info.parent)], name=distribution)
    return list(dist.entry_points.select(group="runlane"))


def lane_module(lane: str) -> str:
    return f"""
        from pydantic import BaseModel, ConfigDict

        from runlane.plugins import hookimpl
        from runlane.plugins.registries import LaneProvider


        class NoOptions(BaseModel):
            model_config = ConfigDict(extra="forbid")


        @hookimpl
        def register_lanes(register):
            register(LaneProvider({lane!r}, NoOptions, lambda options, context: None))
    """


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` for the test's distributions; their modules leave ``sys.modules`` after."""
    directory = tmp_path / "site"
    directory.mkdir()
    monkeypatch.syspath_prepend(str(directory))
    before = set(sys.modules)
    yield directory
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", None) and str(directory) in str(sys.modules[name].__file__):
            del sys.modules[name]


@contextlib.contextmanager
def registered_on_pm(plugins: dict[str, object]) -> Iterator[None]:
    """``plugins`` (name -> plugin) registered on the real manager for the block, as the docs' test does."""
    for name, plugin in plugins.items():
        pm.register(plugin, name=name)
    try:
        yield
    finally:
        for name in plugins:
            if pm.has_plugin(name):
                pm.unregister(name=name)


# ---------------------------------------------------------------------------------------------
# An entry-point name two distributions declare


def test_an_entry_point_name_another_distribution_already_loaded_is_reported_naming_both(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = install(site, "runlane-tilde", {"tilde": "runlane_tilde"}, {"runlane_tilde": lane_module("tilde")})
    second = install(site, "runlane-copycat", {"tilde": "runlane_copycat"}, {"runlane_copycat": lane_module("cat")})
    fresh = new_manager()
    assert load_entry_point_plugins(fresh, [*first, *second]) == ["tilde"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("runlane: skipped plugin 'tilde' from runlane-copycat (runlane_copycat): ")
    assert "also declared by runlane-tilde, whose plugin is loaded" in line
    assert "unique across distributions" in line
    failure = get_plugin_failures()[-1]
    assert (failure.name, failure.distribution) == ("tilde", "runlane-copycat")
    assert "runlane-tilde" in failure.error
    assert collect_registries(fresh).lanes.names() == ["tilde"]  # the first one loaded keeps working

    # Loading the same distribution's entry point again is not a collision.
    assert load_entry_point_plugins(fresh, first) == []
    assert capsys.readouterr().err == ""


def test_a_third_party_entry_point_named_local_does_not_hide_runlane_local_silently(site: Path) -> None:
    # Found before runlane-local's: PYTHONPATH comes before site-packages on sys.path.
    install(site, "runlane-squatter", {"local": "runlane_squatter"}, {"runlane_squatter": lane_module("squat")})
    project = site.parent / "project"
    write(project / "runlane.toml", '[lane]\nuse = "local"\n')
    env = {"PYTHONPATH": str(site)}

    listed = cli(project, "--json", "plugins", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    warnings = [json.loads(line)["warning"] for line in listed.stderr.splitlines()]
    assert any(w["code"] == "plugin" and "skipped plugin 'local' from runlane-local" in w["message"] for w in warnings)
    failures = json.loads(listed.stdout)["failures"]
    (failure,) = [failure for failure in failures if failure["name"] == "local"]
    assert failure["distribution"] == "runlane-local" and "runlane-squatter" in failure["error"]

    selected = cli(project, "runs", "list", env=env)
    assert selected.returncode == 1
    assert "runlane-local is installed, but its plugin 'local' was skipped" in selected.stderr
    assert "Install runlane-local" not in selected.stderr


# ---------------------------------------------------------------------------------------------
# Hook implementations no hookspec names


def test_a_misspelt_or_unknown_hook_is_reported_and_not_listed_and_the_valid_ones_work(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = lane_module("typo-lane") + """
        @hookimpl
        def register_lane(register):
            raise AssertionError("never called")


        @hookimpl
        def on_quantum_flux(register):
            raise AssertionError("never called")
    """
    entry_points = install(site, "runlane-typo", {"typo": "runlane_typo"}, {"runlane_typo": source})
    fresh = new_manager()
    assert load_entry_point_plugins(fresh, entry_points) == ["typo"]
    misspelt, unknown = sorted(capsys.readouterr().err.splitlines())
    assert misspelt.startswith("runlane: plugin 'typo' from runlane-typo implements 'on_quantum_flux', which is")
    assert "newer runlane" in misspelt
    assert unknown.startswith("runlane: plugin 'typo' from runlane-typo implements 'register_lane', which is not")
    assert "Did you mean 'register_lanes'?" in unknown
    assert collect_registries(fresh).lanes.names() == ["typo-lane"]
    (info,) = [info for info in get_plugins(fresh) if info.name == "typo"]
    assert info.hooks == ("register_lanes",)


def test_a_plugin_implementing_no_hook_is_reported_saying_why(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Such a plugin loaded without a word, and its lane was only "Unknown lane" where the config selected it.
    source = lane_module("quiet-lane") + """
        def register_exporters(register):
            raise AssertionError("never called")
    """
    unmarked = source.replace("@hookimpl\n        ", "")
    entry_points = [
        *install(site, "runlane-unmarked", {"unmarked": "runlane_unmarked"}, {"runlane_unmarked": unmarked}),
        *install(
            site, "runlane-function", {"function": "runlane_function:register_lanes"}, {"runlane_function": source}
        ),
    ]
    assert load_entry_point_plugins(new_manager(), entry_points) == ["unmarked", "function"]
    assert capsys.readouterr().err.splitlines() == [
        "runlane: plugin 'unmarked' from runlane-unmarked implements no runlane hook, so it provides nothing: "
        "mark register_exporters, register_lanes with @hookimpl from runlane.plugins.",
        "runlane: plugin 'function' from runlane-function implements no runlane hook, so it provides nothing: "
        "its entry point (runlane_function:register_lanes) names the function 'register_lanes'; name the module "
        "that holds its hook functions instead.",
    ]


# ---------------------------------------------------------------------------------------------
# The runlane releases a plugin declares it works with


def test_a_plugin_made_for_other_runlane_releases_is_reported_loaded_and_listed_as_incompatible(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requires = ("runlane<0.1", "runlane[tui]>=99; extra == 'dashboard'", "pydantic>=2")
    modules = {"runlane_old": lane_module("old-lane")}
    entry_points = install(site, "runlane-old", {"old": "runlane_old"}, modules, requires)
    fresh = new_manager()
    assert load_entry_point_plugins(fresh, entry_points) == ["old"]
    (line,) = capsys.readouterr().err.splitlines()
    installed = importlib.metadata.version("runlane")
    assert line.startswith("runlane: plugin 'old' from runlane-old 0.1 declares it works with runlane<0.1, ")
    assert f"but runlane {installed} is installed; it is loaded and may fail." in line
    assert "pip install 'runlane<0.1'" in line
    assert collect_registries(fresh).lanes.names() == ["old-lane"]  # loaded all the same
    (info,) = [info for info in get_plugins(fresh) if info.name == "old"]
    assert (info.requires_runlane, info.runlane_compatible) == ("<0.1", False)
    assert info.to_json()["runlane_compatible"] is False


def test_a_plugin_made_for_this_runlane_or_declaring_no_range_loads_without_a_word(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fits_module = {"runlane_fits": lane_module("fits-lane")}
    fits = install(site, "runlane-fits", {"fits": "runlane_fits"}, fits_module, ("Runlane>=0.1.0,<100",))
    any_module = {"runlane_any": lane_module("any-lane")}
    unpinned = install(site, "runlane-any", {"any": "runlane_any"}, any_module, ("runlane",))
    fresh = new_manager()
    assert load_entry_point_plugins(fresh, [*fits, *unpinned]) == ["fits", "any"]
    assert capsys.readouterr().err == ""
    infos = {info.name: info for info in get_plugins(fresh)}
    assert (infos["fits"].requires_runlane, infos["fits"].runlane_compatible) == ("<100,>=0.1.0", True)
    assert (infos["any"].requires_runlane, infos["any"].runlane_compatible) == (None, None)


@pytest.mark.parametrize(
    ("requires", "expected"),
    [
        (("runlane (>=0.1,<100)",), "<100,>=0.1"),  # the parenthesized form of older metadata
        (("runlane-local>=0.1", "runlane.x>=7", "runlane ~= 0.1"), "~=0.1"),  # only runlane's own line
        (("runlane>>0.1", "runlane<50"), "<50"),  # a line pip would not have installed is passed over
        (("runlane[tui]>=2; extra == 'dashboard'", "runlane[tui]>=3; python_version >= '3'"), ">=3"),
        (("runlane @ https://example.invalid/runlane.whl",), None),
    ],
)
def test_the_runlane_range_a_plugin_declares_is_read_from_each_form_of_requirement(
    site: Path, requires: tuple[str, ...], expected: str | None
) -> None:
    module = {"runlane_forms": lane_module("forms-lane")}
    fresh = new_manager()
    assert load_entry_point_plugins(fresh, install(site, "runlane-forms", {"forms": "runlane_forms"}, module, requires))
    (info,) = [info for info in get_plugins(fresh) if info.name == "forms"]
    assert info.requires_runlane == expected


def test_plugins_list_shows_a_plugin_made_for_other_runlane_releases(site: Path) -> None:
    install(site, "runlane-new", {"new": "runlane_new"}, {"runlane_new": lane_module("new-lane")}, ("runlane>=99",))
    env = {"PYTHONPATH": str(site)}
    listed = cli(site, "--json", "plugins", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    (new,) = [plugin for plugin in json.loads(listed.stdout)["plugins"] if plugin["name"] == "new"]
    assert (new["requires_runlane"], new["runlane_compatible"]) == (">=99", False)
    assert new["provides"] == {"lanes": ["new-lane"]}
    # With --json, stderr stays JSON lines: the notice is a warning record.
    (notice,) = [json.loads(line)["warning"] for line in listed.stderr.splitlines()]
    assert notice["code"] == "plugin"
    assert notice["message"].startswith("plugin 'new' from runlane-new 0.1 declares it works with runlane>=99")
    table = cli(site, "plugins", "list", env=env)
    assert table.returncode == 0, table.stderr
    assert "plugin 'new' declares it works with runlane>=99, not with the runlane installed" in table.stderr


def test_what_a_plugin_prints_as_it_is_imported_stays_out_of_the_json_on_stdout(site: Path) -> None:
    # It went to stdout before the command's JSON: runlane --json plugins list | jq failed on it.
    module = 'print("runlane-chatty 0.1 loaded")\n' + textwrap.dedent(lane_module("chatty-lane"))
    install(site, "runlane-chatty", {"chatty": "runlane_chatty"}, {"runlane_chatty": module})
    listed = cli(site, "--json", "plugins", "list", env={"PYTHONPATH": str(site)})
    assert listed.returncode == 0, listed.stderr
    assert "chatty" in [plugin["name"] for plugin in json.loads(listed.stdout)["plugins"]]
    notices = [json.loads(line)["warning"] for line in listed.stderr.splitlines()]
    assert notices == [{"code": "plugin", "message": "runlane-chatty 0.1 loaded"}]


# ---------------------------------------------------------------------------------------------
# sys.exit() in a plugin's hook or provider


def test_a_registration_hook_that_exits_skips_its_plugin_and_runlane_still_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from runlane.cli.main import build_app

    class Exiting:
        @hookimpl
        def register_lanes(self, register):
            sys.exit(7)

    plugins = {"exiting-hook": Exiting()}
    with registered_on_pm(plugins):
        app = build_app()
        err = capsys.readouterr().err
        assert "skipped plugin 'exiting-hook'" in err and "failed in register_lanes: SystemExit: 7" in err
        assert not pm.has_plugin("exiting-hook")
        version = CliRunner().invoke(app, ["--version"])
        assert version.exit_code == 0 and version.output.startswith("runlane ")


async def _exit_later(options, context):
    sys.exit(5)


@pytest.mark.parametrize("create", [lambda options, context: sys.exit(4), _exit_later], ids=["sync", "async"])
def test_a_provider_whose_create_exits_is_a_configuration_error_naming_its_plugin(tmp_path: Path, create: Any) -> None:
    from runlane.cli.main import build_app

    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("exiting-lane", NoOptions, create))

    config = write(tmp_path / "runlane.toml", '[lane]\nuse = "exiting-lane"\n')
    plugins = {"exiting-create": Plugin()}
    with registered_on_pm(plugins):
        result = CliRunner().invoke(build_app(), ["-c", str(config), "runs", "list"])
        assert result.exit_code == 1, result.output
        assert result.output.startswith(f"error[configuration_invalid]: {config}: ")  # named by the file first
        assert "The lane 'exiting-lane' of plugin 'exiting-create' failed to start: SystemExit: " in result.output


class _StrictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    region: str

    @field_validator("region")
    @classmethod
    def _known_region(cls, value: str) -> str:
        if value == "exit":
            sys.exit(2)
        return {"eu": "eu-west-1"}[value]  # a KeyError, which pydantic passes on instead of reporting


@pytest.mark.parametrize(("region", "described"), [("mars", "KeyError: 'mars'"), ("exit", "SystemExit: 2")])
def test_an_options_model_whose_validator_raises_is_a_configuration_error_naming_its_plugin(
    tmp_path: Path, region: str, described: str
) -> None:
    # pydantic turns only a validator's ValueError or AssertionError into a ValidationError: anything else
    # came out of `runlane runs list` as a traceback (or sys.exit() as a silent exit).
    from runlane.cli.main import build_app
    from runlane_local import local_lane

    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("regional", _StrictOptions, lambda options, context: local_lane(name="regional")))

    config = write(tmp_path / "runlane.toml", f'[lane]\nuse = "regional"\nregion = "{region}"\n')
    with registered_on_pm({"regional-plugin": Plugin()}):
        result = CliRunner().invoke(build_app(), ["-c", str(config), "runs", "list"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.output == (
        f"error[configuration_invalid]: {config}: Invalid options in [lane] for lane 'regional' (plugin "
        f"'regional-plugin'): its options model _StrictOptions raised {described}. Check the options, or report "
        "it to the plugin's authors.\n"
    )


@pytest.mark.parametrize(
    ("failure", "described"),
    [
        (OSError("cannot reach the service"), "OSError: cannot reach the service"),
        # sys.exit() in the lane's start ended the command silently with the plugin's status, as if it had run.
        (SystemExit(3), "SystemExit: 3"),
    ],
)
def test_a_third_party_lane_that_fails_to_start_is_a_configuration_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException, described: str
) -> None:
    from runlane.cli.main import build_app
    from runlane_local import local_lane

    def create(options, context):
        lane = local_lane(name="unreachable")

        async def start() -> None:
            raise failure

        object.__setattr__(lane.storage, "start", start)
        return lane

    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("unreachable", NoOptions, create))

    write(tmp_path / "unreachable_app.py", 'from runlane import queue\n\ndefault = queue("default", default=True)\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write(tmp_path / "runlane.toml", '[runlane]\ntasks = ["unreachable_app"]\n\n[lane]\nuse = "unreachable"\n')
    with registered_on_pm({"unreachable-plugin": Plugin()}):
        app = build_app()
        plain = CliRunner().invoke(app, ["-c", str(config), "runs", "list"])
        as_json = CliRunner().invoke(app, ["-c", str(config), "--json", "runs", "list"])
    assert plain.exit_code == 1 and "Traceback" not in plain.output, plain.output
    assert (
        "error[configuration_invalid]: The lane 'unreachable' of plugin 'unreachable-plugin' failed to start: "
        f"{described}." in plain.output
    )
    assert as_json.exit_code == 1
    error = json.loads(as_json.output.strip().splitlines()[-1])["error"]
    assert error["code"] == "configuration_invalid"
    assert error["meta"] == {"provider": "unreachable", "plugin": "unreachable-plugin"}


def test_what_a_third_party_storage_driver_raises_while_a_command_runs_names_its_lane_and_plugin(
    site: Path, tmp_path: Path
) -> None:
    """A driver of another distribution that lets its own exception out (an outage it does not report as
    storage_unavailable) fails the command with one error naming the lane and its plugin, not a traceback."""
    from runlane.cli.main import build_app

    write(
        site / "flaky_driver.py",
        """
        from runlane_local import local_storage_driver


        class FlakyDriver:
            def __init__(self):
                self._inner = local_storage_driver()
                self.name, self.profile = "flaky", self._inner.profile

            async def start(self):
                await self._inner.start()

            async def close(self):
                await self._inner.close()

            async def get(self, keys):
                raise ConnectionResetError("the flaky server hung up")

            async def query(self, query):
                raise ConnectionResetError("the flaky server hung up")

            async def with_transaction(self, callback):
                raise ConnectionResetError("the flaky server hung up")
        """,
    )
    from flaky_driver import FlakyDriver  # type: ignore[import-not-found]

    from runlane import LaneDelivery, LaneDeliveryMode, create_lane

    def create(options, context):
        delivery = LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING)
        return create_lane(storage=FlakyDriver(), delivery=delivery, name="flaky", operator_reads=False)

    class Plugin:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("flaky", NoOptions, create))

    write(site / "flaky_app.py", 'from runlane import queue, task\n\nq = queue("default", default=True)\n'
          '\n@task("flaky.noop")\ndef noop(payload: dict) -> None:\n    pass\n')
    config = write(tmp_path / "runlane.toml", '[runlane]\ntasks = ["flaky_app"]\n\n[lane]\nuse = "flaky"\n')
    with registered_on_pm({"flaky-plugin": Plugin()}):
        app = build_app()
        plain = CliRunner().invoke(app, ["-c", str(config), "trigger", "flaky.noop", "{}"])
        as_json = CliRunner().invoke(app, ["-c", str(config), "--json", "trigger", "flaky.noop", "{}"])
    assert plain.exit_code == 1 and "Traceback" not in plain.output, plain.output
    assert (
        "error[internal_error]: The lane 'flaky' of plugin 'flaky-plugin' failed: ConnectionResetError: the flaky "
        "server hung up. Report it to the plugin's authors" in plain.output
    )
    assert as_json.exit_code == 1
    error = json.loads(as_json.output.strip().splitlines()[-1])["error"]
    assert error["code"] == "internal_error"
    assert error["meta"] == {"provider": "flaky", "plugin": "flaky-plugin", "exception": "ConnectionResetError"}


def test_a_stop_signal_while_a_third_party_lane_waits_for_its_storage_ends_the_command_as_for_any_lane(
    site: Path,
) -> None:
    # The stop's typer.Exit(0) was taken for the lane's own failure: "failed to start: Exit: 0", status 1.
    install(
        site,
        "runlane-later",
        {"later": "runlane_later"},
        {
            "runlane_later": """
                import asyncio
                import os
                import signal

                from pydantic import BaseModel, ConfigDict
                from runlane_local import local_lane

                from runlane import ErrorCode, RunlaneError
                from runlane.plugins import hookimpl
                from runlane.plugins.registries import LaneProvider


                class NoOptions(BaseModel):
                    model_config = ConfigDict(extra="forbid")


                def create(options, context):
                    lane = local_lane(name="later")

                    async def start():
                        # Stopped (as by Ctrl-C) once the command waits for the storage to answer.
                        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
                        raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "not up yet", retryable=True)

                    object.__setattr__(lane.storage, "start", start)
                    return lane


                @hookimpl
                def register_lanes(register):
                    register(LaneProvider("later", NoOptions, create))
            """
        },
    )
    project = site.parent / "project"
    write(project / "later_app.py", 'from runlane import queue\n\ndefault = queue("default", default=True)\n')
    write(project / "runlane.toml", '[runlane]\ntasks = ["later_app"]\n[lane]\nuse = "later"\n')
    result = cli(project, "--json", "work", env={"PYTHONPATH": str(site)}, timeout=30)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["type"] for line in result.stdout.splitlines()] == ["storage_waiting", "stopped"]
    assert "error" not in result.stderr


# ---------------------------------------------------------------------------------------------
# Failures whose message spans lines, and an observer failing while a command runs


def test_a_failure_whose_message_spans_lines_is_still_one_notice_naming_the_plugin(site: Path) -> None:
    """A pydantic ValidationError (a plugin building its settings in a hook) spans several lines."""
    install(
        site,
        "runlane-settings",
        {"settings": "runlane_settings"},
        {
            "runlane_settings": """
                from runlane.plugins import hookimpl


                @hookimpl
                def register_exporters(register):
                    raise ValueError("2 problems\\n  endpoint: required\\n  port: not a number")
            """
        },
    )
    install(
        site,
        "runlane-tools",
        {"tools": "runlane_tools"},
        {
            "runlane_tools": """
                from runlane.plugins import hookimpl


                @hookimpl
                def register_commands(app):
                    raise RuntimeError("first line\\nsecond line")
            """
        },
    )
    project = site.parent / "project"
    write(project / "runlane.toml", '[lane]\nuse = "local"\n')
    env = {"PYTHONPATH": str(site)}

    as_json = cli(project, "--json", "plugins", "list", env=env)
    assert as_json.returncode == 0, as_json.stderr
    messages = [json.loads(line)["warning"]["message"] for line in as_json.stderr.splitlines()]
    assert sorted(messages) == [
        "skipped plugin 'settings' from runlane-settings: Plugin 'settings' failed in register_exporters: "
        "ValueError: 2 problems endpoint: required port: not a number",
        "skipped plugin 'tools' from runlane-tools: register_commands raised RuntimeError: first line second line; "
        "the plugin is left out whole, its lanes and other hooks too.",
    ]
    plain = cli(project, "plugins", "list", env=env)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stderr.splitlines()  # the notices, then the command's own list of failures
    assert sum(line.startswith("runlane: skipped plugin ") for line in lines) == 2, lines
    assert all("skipped plugin " in line for line in lines), lines


def test_a_lane_of_a_plugin_skipped_for_its_commands_is_unknown_naming_the_skipped_plugin(site: Path) -> None:
    # The plugin is unregistered whole when register_commands fails: its lane goes with its commands, and
    # the unknown lane listed only the installed ones, as if the plugin providing it had never been there.
    install(
        site,
        "runlane-lanes",
        {"lanes": "runlane_lanes"},
        {
            "runlane_lanes": """
                from pydantic import BaseModel, ConfigDict

                from runlane.plugins import hookimpl
                from runlane.plugins.registries import LaneProvider


                class NoOptions(BaseModel):
                    model_config = ConfigDict(extra="forbid")


                @hookimpl
                def register_lanes(register):
                    register(LaneProvider("lanes-lane", NoOptions, lambda options, context: None))


                @hookimpl
                def register_commands(app):
                    raise RuntimeError("command hook broke")
            """
        },
    )
    project = site.parent / "project"
    write(project / "runlane.toml", '[lane]\nuse = "lanes-lane"\n')
    result = cli(project, "runs", "list", env={"PYTHONPATH": str(site)})
    assert result.returncode == 1
    notice, error = result.stderr.splitlines()
    assert notice == (
        "runlane: skipped plugin 'lanes' from runlane-lanes: register_commands raised RuntimeError: command hook "
        "broke; the plugin is left out whole, its lanes and other hooks too."
    )
    assert error.startswith("error[configuration_invalid]: runlane.toml: Unknown lane 'lanes-lane'; installed lanes: ")
    assert error.endswith(
        "Plugin 'lanes' was skipped, and it may be the one that provides it: `runlane plugins list` says why."
    )


def test_an_observer_that_raises_while_a_command_runs_is_one_log_record_of_it(site: Path) -> None:
    install(
        site,
        "runlane-brittle",
        {"brittle": "runlane_brittle"},
        {
            "runlane_brittle": """
                from runlane.plugins import hookimpl


                def observe(observation):
                    raise RuntimeError("observer broke")


                @hookimpl
                def register_observers(register):
                    register(observe)
            """
        },
    )
    project = site.parent / "project"
    write(
        project / "app.py",
        """
        from runlane import queue, task

        default = queue("default", default=True)


        @task("app.hello", queue=default)
        def hello(payload: dict) -> None:
            return None
        """,
    )
    write(project / "runlane.toml", '[runlane]\ntasks = ["app"]\n\n[lane]\nuse = "sqlite"\npath = "runs.db"\n')
    env = {"PYTHONPATH": str(site)}

    as_json = cli(project, "--json", "trigger", "app.hello", "{}", env=env)
    assert as_json.returncode == 0, as_json.stderr
    records = [json.loads(line) for line in as_json.stderr.splitlines()]  # every line is a JSON record
    assert records and all(record["type"] == "log" for record in records), records
    assert {record["logger"] for record in records} == {"runlane.observers"}
    assert all("of plugin 'brittle' raised on run." in record["message"] for record in records)
    assert all("RuntimeError: observer broke" in record["exception"] for record in records)
    plain = cli(project, "trigger", "app.hello", "{}", env=env)
    assert plain.returncode == 0, plain.stderr
    assert "of plugin 'brittle' raised on run.created" in plain.stderr


# ---------------------------------------------------------------------------------------------
# Plugin commands


def test_register_commands_taking_no_arguments_keeps_its_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    from runlane.cli.main import build_app

    calls = []

    class Quiet:
        @hookimpl
        def register_commands(self):
            calls.append("register_commands")

        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("quiet-lane", NoOptions, lambda options, context: None))

    plugins = {"quiet": Quiet()}
    with registered_on_pm(plugins):
        build_app()
        assert calls == ["register_commands"]
        assert "skipped plugin 'quiet'" not in capsys.readouterr().err
        assert pm.has_plugin("quiet")
        assert manager.get_registries().lanes.get("quiet-lane").plugin == "quiet"


def test_a_plugin_command_that_raises_is_reported_naming_command_and_plugin() -> None:
    from runlane.cli.main import build_app

    class Exploding:
        @hookimpl
        def register_commands(self, app):
            @app.command("explode")
            def explode() -> None:
                raise ValueError("the plugin's own bug")

            tools = typer.Typer()

            @tools.command("leave")
            def leave() -> None:
                raise typer.Exit(3)  # how a command chooses to end is not a failure

            app.add_typer(tools, name="exploding-tools")

    plugins = {"exploding": Exploding()}
    with registered_on_pm(plugins):
        app = build_app()
        plain = CliRunner().invoke(app, ["explode"])
        assert plain.exit_code == 1 and isinstance(plain.exception, SystemExit)
        assert (
            "error[internal_error]: command 'explode' of plugin 'exploding' failed: ValueError: the plugin's own bug."
            in plain.output
        )
        as_json = CliRunner().invoke(app, ["explode", "--json"])
        assert as_json.exit_code == 1
        error = json.loads(as_json.output.strip().splitlines()[-1])["error"]
        assert error["code"] == "internal_error"
        assert error["meta"] == {"command": "explode", "plugin": "exploding", "exception": "ValueError"}
        assert "Traceback" not in plain.output + as_json.output
        assert CliRunner().invoke(app, ["exploding-tools", "leave"]).exit_code == 3


def test_a_plugin_command_on_a_process_local_lane_says_it_reads_an_empty_lane_of_its_own(tmp_path: Path) -> None:
    # with_runtime, the helper docs/plugin-hooks.md gives plugin commands, builds the command's own local
    # lane: without a word, "0 queued" read as the state of the runs a runlane dev holds.
    from runlane.cli.main import build_app, with_runtime

    class Backlog:
        @hookimpl
        def register_commands(self, app):
            @app.command("queued-count")
            def backlog(ctx: typer.Context) -> None:
                async def body(runtime: Any) -> None:
                    page = await runtime.runs.list(statuses=["queued"], limit=100)
                    typer.echo(f"{len(page.data)} queued")

                with_runtime(ctx, body)

    module = f"backlog_tasks_{tmp_path.name}"
    write(tmp_path / f"{module}.py", 'from runlane import queue\n\ndefault = queue("default", default=True)\n')
    tasks = f'[runlane]\ntasks = ["{module}"]\n'
    local = write(tmp_path / "local.toml", f'{tasks}[lane]\nuse = "local"\n')
    shared = write(tmp_path / "sqlite.toml", f'{tasks}[lane]\nuse = "sqlite"\npath = "r.db"\n')
    with registered_on_pm({"backlog-plugin": Backlog()}):
        app = build_app()
        plain = CliRunner().invoke(app, ["-c", str(local), "queued-count"])
        assert plain.exit_code == 0, plain.output
        assert "0 queued" in plain.stdout
        assert (
            "warning: the 'local' lane keeps runs in one process, so command 'queued-count' of plugin 'backlog-plugin' "
            "runs on an empty lane of its own" in plain.stderr
        )
        as_json = CliRunner().invoke(app, ["-c", str(local), "--json", "queued-count"])
        warning = json.loads(as_json.stderr.strip().splitlines()[-1])["warning"]
        assert warning["code"] == "process_local_lane" and "`runlane dev`" in warning["message"]
        quiet = CliRunner().invoke(app, ["-c", str(shared), "queued-count"])
        assert quiet.exit_code == 0 and quiet.stdout == "0 queued\n" and "warning" not in quiet.stderr
        # runlane's own plugins' commands say what the lane means for them themselves.
        consume = CliRunner().invoke(app, ["-c", str(local), "sqs", "consume"])
        assert consume.exit_code == 1 and "warning" not in consume.stderr, consume.stderr


# ---------------------------------------------------------------------------------------------
# A name one plugin registers twice


def test_a_name_one_plugin_registers_twice_says_so() -> None:
    from runlane.cli.main import build_app

    class Twice:
        @hookimpl
        def register_lanes(self, register):
            register(LaneProvider("doubled", NoOptions, lambda options, context: None))
            register(LaneProvider("doubled", NoOptions, lambda options, context: None))

    fresh = new_manager()
    fresh.register(Twice(), name="broken")
    with pytest.raises(RunlaneError) as raised:
        collect_registries(fresh)
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert raised.value.message == (
        "The lane 'doubled' is registered twice by plugin 'broken'; report it to the plugin's authors."
    )

    plugins = {"broken-twice": Twice()}
    with registered_on_pm(plugins):
        listed = CliRunner().invoke(build_app(), ["--json", "plugins", "list"])
        assert listed.exit_code == 0, listed.output
        collisions = json.loads(listed.output.strip().splitlines()[-1])["collisions"]
        assert "the lane 'doubled' is registered twice by plugin 'broken-twice'; selecting it fails" in collisions


# ---------------------------------------------------------------------------------------------
# What to install for a name nothing registered


def test_no_distribution_is_suggested_for_a_storage_driver_nobody_registers() -> None:
    drivers = collect_registries(new_manager()).storage_drivers
    for name in ("local", "sqlite"):
        with pytest.raises(RunlaneError) as raised:
            drivers.get(name)
        assert "Install" not in raised.value.message and "runlane-local" not in raised.value.message
    with pytest.raises(RunlaneError) as raised:
        collect_registries(new_manager()).lanes.get("sqlite")
    assert "runlane-local" in raised.value.message  # runlane-local does register the sqlite lane


def test_every_first_party_hint_names_what_its_installed_distribution_registers() -> None:
    from runlane.plugins.registries import _FIRST_PARTY_HINTS

    registries = manager.get_registries()
    by_kind = {registry.kind: registry for registry in (
        registries.lanes, registries.storage_drivers, registries.transports, registries.exporters
    )}  # fmt: skip
    plugins = get_plugins()
    origins = {info.name: info.distribution for info in plugins}
    for (kind, name), distribution in _FIRST_PARTY_HINTS.items():
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        if kind == "command":  # commands are the CLI's, not a registry's: as `runlane plugins list` finds them
            from runlane.cli.plugins import _commands_by_plugin

            commands = _commands_by_plugin()
            assert any(
                info.distribution == distribution and name in commands.get(info.name, ()) for info in plugins
            ), f"{distribution} registers no command {name!r}"
            continue
        assert name in by_kind[kind], f"{distribution} registers no {kind} {name!r}"
        assert origins[by_kind[kind].get(name).plugin] == distribution
