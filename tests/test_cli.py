"""The ``runlane`` command line.

End-to-end flows run the installed console script in a subprocess inside a temporary project. Flows
that need state shared between commands (trigger, then list, execute, inspect) run the real app with
Typer's ``CliRunner`` in this process, over a config whose runtime factory opens one SQLite file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import shlex
import stat
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cli_support import cli, make_project, ndjson, run_json_until, write
from typer.testing import CliRunner

from runlane.cli.main import app
from runlane.config import load_config
from runlane.errors import ErrorCode, RunlaneError


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with a scheduled task, configured through `runlane init config`."""
    return make_project(tmp_path)


# ---------------------------------------------------------------------------------------------
# Subprocess: the installed script


def test_version(tmp_path: Path) -> None:
    result = cli(tmp_path, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "runlane 0.1.0"


def test_python_dash_m_runs_the_same_cli(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "runlane", "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "runlane 0.1.0"


def test_init_config_writes_a_loadable_commented_config(tmp_path: Path) -> None:
    result = cli(tmp_path, "--json", "init", "config", "--tasks", "app.tasks", "--tasks", "app.more")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"path": "runlane.toml", "overwritten": False}
    text = (tmp_path / "runlane.toml").read_text()
    assert text.startswith("# runlane.toml")
    loaded = load_config(cwd=tmp_path)
    assert loaded is not None
    assert loaded.runlane.tasks == ["app.tasks", "app.more"]
    # The durable single-machine default: a SQLite file next to the config.
    assert loaded.lane is not None and loaded.lane.use == "sqlite"
    assert 'path = "runlane.db"' in text
    assert loaded.dev.tick_interval == "5s"


@pytest.mark.parametrize("lane", ["postgres-polling", "postgres-sqs"])
def test_init_config_for_a_production_lane_writes_options_its_plugin_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: str
) -> None:
    from runlane.plugins.manager import get_registries
    from runlane.plugins.registries import validate_options

    result = cli(tmp_path, "init", "config", "--tasks", "app.tasks", "--lane", lane)
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("RUNLANE_DEFAULT_QUEUE_URL", "https://sqs.us-east-1.amazonaws.com/123456789012/default")
    # A deploy that forgot the database URL is told so, instead of waiting for a server on localhost.
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(RunlaneError) as missing:
        load_config(cwd=tmp_path)
    assert missing.value.code is ErrorCode.CONFIGURATION_INVALID and "DATABASE_URL" in missing.value.message
    monkeypatch.setenv("DATABASE_URL", "postgresql://db.internal:5432/app")
    loaded = load_config(cwd=tmp_path)
    assert loaded is not None and loaded.lane is not None and loaded.lane.use == lane
    validate_options(get_registries().lanes.get(lane), loaded.lane.options)


def test_init_config_for_a_third_party_lane_lists_the_options_its_plugin_takes(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "runlane_acme-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: runlane-acme\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[runlane]\nacme = runlane_acme\n")
    write(
        site / "runlane_acme.py",
        """
        import enum
        from pathlib import Path

        from pydantic import BaseModel, ConfigDict, Field

        from runlane import ErrorCode, RunlaneError
        from runlane.plugins import hookimpl
        from runlane.plugins.registries import LaneProvider


        class Mode(enum.Enum):
            FAST = "fast"
            SAFE = "safe"


        class AcmeOptions(BaseModel):
            model_config = ConfigDict(extra="forbid")

            url: str = Field(description="Where the Acme server listens.")
            timeout_seconds: float = 5.0
            verify: bool = True
            tags: list[str] = Field(default_factory=lambda: ["a", "b"])
            region: str | None = None
            mode: Mode = Mode.SAFE
            folder: Path = Path("spool")
            template: str = "${run_id}.log"


        def create(options, context):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"acme options: {options.model_dump_json()}")


        @hookimpl
        def register_lanes(register):
            register(LaneProvider("acme", AcmeOptions, create))
        """,
    )
    write(tmp_path / "app" / "__init__.py", "")
    write(tmp_path / "app" / "tasks.py", 'from runlane import queue\n\ndefault = queue("default", default=True)\n')
    env = {"PYTHONPATH": str(site)}
    result = cli(tmp_path, "init", "config", "--tasks", "app.tasks", "--lane", "acme", env=env)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "runlane.toml").read_text()
    assert 'use = "acme"\n' in text
    assert "# The options of 'acme' (plugin 'acme'); uncomment and set the required ones.\n" in text
    assert "# url =   # required: Where the Acme server listens.\n" in text
    assert "# timeout_seconds = 5.0\n# verify = true\n# tags = [\"a\", \"b\"]\n# region =\n" in text
    # An enum's or a path's default is written as the value that reads back as it (they were left blank), and
    # a $ as $$, so that ${VAR} expansion gives the default back.
    assert '# mode = "safe"\n# folder = "spool"\n# template = "$${run_id}.log"\n' in text
    # As written, the config names the required key; once it is set, the plugin gets the options.
    listed = cli(tmp_path, "runs", "list", env=env)
    assert listed.returncode == 1 and "'url'" in listed.stderr and "Traceback" not in listed.stderr
    filled = text.replace("# url =   # required", 'url = "http://127.0.0.1:1"   # required')
    (tmp_path / "runlane.toml").write_text(filled.replace("# verify = true", "verify = false"))
    listed = cli(tmp_path, "runs", "list", env=env)
    assert listed.returncode == 1
    assert 'acme options: {"url":"http://127.0.0.1:1","timeout_seconds":5.0,"verify":false' in listed.stderr
    for key in ("mode", "folder", "template"):
        filled = filled.replace(f"# {key} =", f"{key} =")
    (tmp_path / "runlane.toml").write_text(filled)
    listed = cli(tmp_path, "runs", "list", env=env)
    assert '"mode":"safe","folder":"spool","template":"${run_id}.log"}' in listed.stderr, listed.stderr


def test_init_config_then_trigger_then_dev_once_executes_the_run(tmp_path: Path) -> None:
    """The first steps of a new project, each a separate process sharing the SQLite file."""
    write(tmp_path / "app" / "__init__.py", "")
    write(
        tmp_path / "app" / "tasks.py",
        "from runlane import queue, task\n\n"
        "default = queue('default', default=True)\n\n"
        "@task('hello.greet', queue=default)\n"
        "def greet(payload: dict) -> dict:\n"
        "    return {'greeting': 'hello ' + payload['name']}\n",
    )
    assert cli(tmp_path, "init", "config", "--tasks", "app.tasks").returncode == 0
    triggered = cli(tmp_path, "--json", "trigger", "hello.greet", '{"name": "ada"}')
    assert triggered.returncode == 0, triggered.stderr
    run_id = json.loads(triggered.stdout)["run"]["id"]
    assert (tmp_path / "runlane.db").exists()
    once = cli(tmp_path, "--json", "dev", "--once")
    assert once.returncode == 0, once.stderr
    executed = [record["run"] for record in ndjson(once.stdout) if record["type"] == "run"]
    assert [(run["id"], run["status"]) for run in executed] == [(run_id, "succeeded")]
    shown = cli(tmp_path, "--json", "runs", "get", run_id)
    assert shown.returncode == 0, shown.stderr
    run = json.loads(shown.stdout)["run"]
    assert run["status"] == "succeeded" and run["output"] == {"greeting": "hello ada"}
    # No dev process is running: the file is the shared state, so no bridge session is involved.
    assert "session" not in (shown.stderr + once.stderr)


def test_init_config_on_a_full_disk_leaves_no_file_behind(tmp_path: Path) -> None:
    # A write that fails midway (here: a file size limit, as a full disk does) must not leave an empty or
    # cut-off runlane.toml, which the next attempt would then refuse to overwrite.
    import resource

    from cli_support import RUNLANE, cli_env

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))

    failed = subprocess.run(
        [RUNLANE, "init", "config", "--tasks", "app.tasks"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, env=cli_env(), preexec_fn=limited,
    )  # fmt: skip
    assert failed.returncode == 1 and "Cannot write" in failed.stderr, failed.stderr
    assert list(tmp_path.iterdir()) == []
    assert cli(tmp_path, "init", "config", "--tasks", "app.tasks").returncode == 0
    assert (tmp_path / "runlane.toml").read_text().startswith("# runlane.toml")


def test_init_config_overwrites_a_linked_config_where_the_link_points(tmp_path: Path) -> None:
    (tmp_path / "dotfiles").mkdir()
    (tmp_path / "dotfiles" / "runlane.toml").write_text("# mine\n")
    (tmp_path / "runlane.toml").symlink_to(tmp_path / "dotfiles" / "runlane.toml")
    assert cli(tmp_path, "init", "config", "--tasks", "app.tasks", "--overwrite").returncode == 0
    assert (tmp_path / "runlane.toml").is_symlink()
    assert (tmp_path / "dotfiles" / "runlane.toml").read_text().startswith("# runlane.toml")


def test_init_config_never_overwrites_without_the_flag(tmp_path: Path) -> None:
    (tmp_path / "runlane.toml").write_text("# mine\n")
    refused = cli(tmp_path, "init", "config")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error[configuration_invalid]: runlane.toml already exists")
    assert "--overwrite" in refused.stderr
    assert (tmp_path / "runlane.toml").read_text() == "# mine\n"

    replaced = cli(tmp_path, "--json", "init", "config", "--overwrite", "--lane", "sqlite")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout)["overwritten"] is True
    assert 'use = "sqlite"' in (tmp_path / "runlane.toml").read_text()
    # Without --tasks (or --runtime) the config names app.tasks, which it says stands in for your module.
    assert json.loads(replaced.stderr)["warning"]["code"] == "placeholder_tasks"
    assert 'tasks = ["app.tasks"]' in (tmp_path / "runlane.toml").read_text()
    # Where the project's module is app.tasks after all, it is no placeholder.
    write(tmp_path / "app" / "tasks.py", "")
    mine = cli(tmp_path, "--json", "init", "config", "--overwrite")
    assert mine.returncode == 0 and mine.stderr == "", mine.stderr


def test_init_config_never_replaces_what_is_not_a_regular_file(tmp_path: Path) -> None:
    # With --overwrite it renamed the new config over whatever was there: a FIFO, a socket or a device such
    # as /dev/null (run as root) became a regular file holding the config.
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    for args in ((), ("--overwrite",)):
        refused = cli(tmp_path, "init", "config", "--path", str(fifo), *args)
        assert refused.returncode == 1
        assert refused.stderr.startswith(f"error[configuration_invalid]: {fifo} is not a regular file"), refused.stderr
        assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_init_config_refuses_to_write_over_pyproject_toml(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[project]\nname = "app"\n')
    for path in ("pyproject.toml", "sub/pyproject.toml"):
        result = cli(tmp_path, "init", "config", "--path", path, "--overwrite")
        assert result.returncode == 2 and "[tool.runlane]" in result.stderr
    assert (tmp_path / "pyproject.toml").read_text() == '[project]\nname = "app"\n'
    assert not (tmp_path / "sub").exists()


def test_init_config_does_not_hide_a_tool_runlane_table_in_pyproject_toml(tmp_path: Path) -> None:
    """The commands read a runlane.toml first: written beside a configured pyproject.toml, it would take
    that config's place (another lane, another database) without a word."""
    pyproject = '[project]\nname = "app"\n\n[tool.runlane.lane]\nuse = "sqlite"\npath = "app.db"\n'
    write(tmp_path / "pyproject.toml", pyproject)
    refused = cli(tmp_path, "init", "config")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error[configuration_invalid]: pyproject.toml already holds a Runlane config")
    assert not (tmp_path / "runlane.toml").exists()
    elsewhere = cli(tmp_path, "init", "config", "--path", "deploy/runlane.toml")  # no pyproject.toml there
    assert elsewhere.returncode == 0, elsewhere.stderr
    anyway = cli(tmp_path, "init", "config", "--overwrite")
    assert anyway.returncode == 0, anyway.stderr
    assert (tmp_path / "runlane.toml").exists() and (tmp_path / "pyproject.toml").read_text() == pyproject


def test_init_config_writes_the_config_that_c_names(tmp_path: Path) -> None:
    # `runlane -c staging.toml init config` is followed by `runlane -c staging.toml ...`: it writes there.
    written = cli(tmp_path, "-c", "staging.toml", "init", "config", "--lane", "local")
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "staging.toml").is_file() and not (tmp_path / "runlane.toml").exists()
    assert load_config(tmp_path / "staging.toml") is not None
    same = cli(tmp_path, "-c", "staging.toml", "init", "config", "--path", "./staging.toml", "--overwrite")
    assert same.returncode == 0, same.stderr
    # Two different files named: nothing is written, and the user hears which two.
    both = cli(tmp_path, "-c", "staging.toml", "init", "config", "--path", "other.toml")
    assert both.returncode == 2 and both.stdout == ""
    assert "-c/--config staging.toml and --path other.toml name different files" in both.stderr
    assert not (tmp_path / "other.toml").exists()
    # The pyproject.toml guard holds whichever option names it.
    write(tmp_path / "pyproject.toml", '[project]\nname = "app"\n')
    refused = cli(tmp_path, "-c", "pyproject.toml", "init", "config", "--overwrite")
    assert refused.returncode == 2 and "[tool.runlane]" in refused.stderr
    assert (tmp_path / "pyproject.toml").read_text() == '[project]\nname = "app"\n'


def test_init_config_with_runtime_and_path(tmp_path: Path) -> None:
    result = cli(tmp_path, "init", "config", "--path", "conf/runlane.toml", "--runtime", "app.runtime:make")
    assert result.returncode == 0, result.stderr
    loaded = load_config(tmp_path / "conf" / "runlane.toml")
    assert loaded is not None
    assert loaded.runlane.runtime == "app.runtime:make"
    assert loaded.lane is None


def test_runs_triggered_by_the_applications_own_runtime_are_seen_and_run_by_an_init_config(tmp_path: Path) -> None:
    """An application that builds its runtime with create_runlane() defaults and a `runlane init config
    --tasks` for its workers use one environment."""
    write(tmp_path / "app" / "__init__.py", "")
    write(
        tmp_path / "app" / "tasks.py",
        "from runlane import create_runlane, queue, task\n"
        "from runlane_local import sqlite_lane\n\n"
        "default = queue('default', default=True)\n\n"
        "@task('emails.welcome')\n"
        "def send_welcome(payload: dict) -> None:\n"
        "    return None\n\n"
        "runlane = create_runlane(lane=sqlite_lane('runlane.db'), queues=[default], tasks=[send_welcome])\n",
    )
    assert cli(tmp_path, "init", "config", "--tasks", "app.tasks").returncode == 0
    produced = subprocess.run(
        [sys.executable, "-c", "from app.tasks import runlane, send_welcome\n"
         "print(runlane.sync.trigger(send_welcome, {}).run.id)\nrunlane.sync.close()"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr
    run_id = produced.stdout.strip()
    listed = cli(tmp_path, "--json", "runs", "list")
    assert [run["id"] for run in json.loads(listed.stdout)["data"]] == [run_id]
    drained = cli(tmp_path, "--json", "work", "--drain")
    assert drained.returncode == 0, drained.stderr
    shown = json.loads(cli(tmp_path, "--json", "runs", "get", run_id).stdout)
    assert shown["run"]["status"] == "succeeded"


def test_init_config_with_a_runtime_leaves_the_environment_to_it(tmp_path: Path) -> None:
    write(
        tmp_path / "app_runtime_env.py",
        """
        from runlane import create_runlane, queue, task
        from runlane_local import sqlite_lane

        default = queue("default", default=True)


        @task("hello")
        def hello(payload: dict) -> dict:
            return payload


        def make():
            return create_runlane(lane=sqlite_lane("app.db"), queues=[default], tasks=[hello], environment="prod")
        """,
    )
    assert cli(tmp_path, "init", "config", "--runtime", "app_runtime_env:make").returncode == 0
    triggered = cli(tmp_path, "--json", "trigger", "hello", "{}")
    assert triggered.returncode == 0, triggered.stderr  # no environment written to contradict the runtime's
    assert json.loads(triggered.stdout)["run"]["environment"] == {"name": "prod"}


def test_init_config_rejects_conflicting_or_malformed_targets(tmp_path: Path) -> None:
    both = cli(tmp_path, "--json", "init", "config", "--runtime", "app.runtime:make", "--tasks", "app.tasks")
    assert both.returncode == 2
    assert "Error: --runtime and --tasks exclude each other" in both.stderr
    # The factory builds its own lane: a --lane with it would be dropped without a word.
    with_lane = cli(tmp_path, "init", "config", "--runtime", "app.runtime:make", "--lane", "local")
    assert with_lane.returncode == 2
    assert "Error: --runtime and --lane exclude each other" in with_lane.stderr
    malformed = cli(tmp_path, "init", "config", "--runtime", "app.runtime")
    assert malformed.returncode == 2
    assert "Invalid value for '--runtime': 'app.runtime' must be written as 'module:attribute'" in malformed.stderr
    assert not (tmp_path / "runlane.toml").exists()


def test_plugins_list_json(tmp_path: Path) -> None:
    result = cli(tmp_path, "--json", "plugins", "list")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    by_name = {plugin["name"]: plugin for plugin in document["plugins"]}
    assert by_name["local"]["provides"]["lanes"] == ["local", "sqlite"]
    assert by_name["local"]["distribution"] == "runlane-local"
    assert by_name["runlane.plugins.defaults"]["version"] == "0.1.0"
    # The commands a plugin adds are listed with what it provides.
    assert by_name["postgres"]["provides"]["commands"] == ["postgres"]
    assert by_name["sqs"]["provides"]["commands"] == ["sqs"]
    assert document["failures"] == [] and document["collisions"] == []


def test_plugins_list_human(tmp_path: Path) -> None:
    result = cli(tmp_path, "plugins", "list")
    assert result.returncode == 0, result.stderr
    assert "runlane-local" in result.stdout and "lanes: local" in result.stdout
    assert "commands: postgres" in result.stdout


def test_plugins_list_survives_a_plugin_that_fails_to_register_and_a_name_two_plugins_register(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    write(
        site / "clash_plugins.py",
        """
from pydantic import BaseModel, ConfigDict
from runlane.plugins import hookimpl
from runlane.plugins.registries import LaneProvider


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Clash:
    @hookimpl
    def register_lanes(self, register):
        register(LaneProvider("sqlite", Options, lambda options, context: None))

    @hookimpl
    def register_commands(self, app):
        app.command("tools")(lambda: print("clash tools"))


class Echo:
    @hookimpl
    def register_commands(self, app):
        app.command("tools")(lambda: print("echo tools"))


class Broken:
    @hookimpl
    def register_lanes(self, register):
        raise RuntimeError("the plugin's own bug")


clash = Clash()
echo = Echo()
broken = Broken()
""",
    )
    write(
        site / "clash_tasks.py",
        "from runlane import queue\n\ndefault = queue('default', default=True)\n",
    )
    dist = site / "clash_plugins-1.0.dist-info"
    write(dist / "METADATA", "Metadata-Version: 2.1\nName: clash-plugins\nVersion: 1.0\n")
    entry_points = "clash = clash_plugins:clash\necho = clash_plugins:echo\nbroken = clash_plugins:broken\n"
    write(dist / "entry_points.txt", "[runlane]\n" + entry_points)
    env = {"PYTHONPATH": str(site)}
    listed = cli(tmp_path, "--json", "plugins", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    document = json.loads(listed.stdout)
    assert [failure["name"] for failure in document["failures"]] == ["broken"]
    assert document["collisions"] == [
        "the lane 'sqlite' is registered by plugin 'local' and plugin 'clash'; selecting it fails",
        "the command 'tools' is added by plugins 'clash' and 'echo'; it is added by neither",
    ]
    # A configuration that does not select the ambiguous name still works; one that does names both plugins.
    write(tmp_path / "runlane.toml", '[runlane]\ntasks = ["clash_tasks"]\n\n[lane]\nuse = "local"\n')
    assert cli(tmp_path, "runs", "list", env=env).returncode == 0
    write(tmp_path / "runlane.toml", '[runlane]\ntasks = ["clash_tasks"]\n\n[lane]\nuse = "sqlite"\npath = "x.db"\n')
    chosen = cli(tmp_path, "runs", "list", env=env)
    assert chosen.returncode == 1 and "plugin 'local' and plugin 'clash'" in chosen.stderr
    assert "Traceback" not in chosen.stderr


def test_dev_once_materializes_and_executes_a_scheduled_run(project: Path) -> None:
    result = cli(project, "--json", "dev", "--once")
    assert result.returncode == 0, result.stderr
    records = ndjson(result.stdout)
    assert [record["type"] for record in records] == ["tick", "worker_started", "run", "worker_stopped"]
    assert records[0]["tick"]["materialized"] == 1
    run = records[2]["run"]
    assert run["task_id"] == "emails.welcome"
    assert run["status"] == "succeeded"
    assert run["output"] == {"sent": "user_1"}
    assert records[3]["runs"] == 1
    assert all(record["at"].endswith("Z") for record in records)


def test_dev_once_human_output_is_timestamped_lines(project: Path) -> None:
    result = cli(project, "dev", "--once", "--max-runs", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4
    assert all(line[:4].isdigit() and line[23] == "Z" for line in lines)
    assert " tick materialized=1 deliveryRequested=" in lines[0]
    assert " run succeeded run_" in lines[2] and "task=emails.welcome queue=emails attempts=1" in lines[2]
    assert lines[3].endswith("worker stopped runs=1")


def test_dev_once_rejects_empty_poll_delay(project: Path) -> None:
    result = cli(project, "dev", "--once", "--empty-poll-delay", "1s")
    assert result.returncode == 2
    assert result.stderr.endswith("Error: --empty-poll-delay applies only without --once.\n")


def test_tick_json_and_card(project: Path) -> None:
    result = cli(project, "--json", "tick", "--schedule-materialization-limit", "10", "--outbox-claim-limit", "5")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tick"]["materialized"] == 1
    human = cli(project, "tick")
    assert human.returncode == 0, human.stderr
    assert "tick complete" in human.stdout and "materialized" in human.stdout


def test_work_drain_json_on_an_empty_local_lane(project: Path) -> None:
    result = cli(project, "--json", "work", "--drain", "--queue", "emails", "--concurrency", "2")
    assert result.returncode == 0, result.stderr
    records = ndjson(result.stdout)
    assert [record["type"] for record in records] == ["worker_started", "worker_stopped"]
    assert records[0]["queues"] == ["emails"] and records[0]["concurrency"] == 2
    assert records[1]["runs"] == 0
    # A worker of its own on the in-memory lane sees only its own process's runs, and says so.
    warning = json.loads(result.stderr.splitlines()[0])["warning"]
    assert warning["code"] == "process_local_lane" and "sees only runs created in it" in warning["message"]


def test_work_max_runs_needs_drain(project: Path) -> None:
    result = cli(project, "work", "--max-runs", "3")
    assert result.returncode == 2
    assert "Error: --max-runs applies only with --drain." in result.stderr


def test_trigger_invalid_payload_json_is_a_clear_error(project: Path) -> None:
    result = cli(project, "trigger", "emails.welcome", "{bad")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Error: Invalid value for 'PAYLOAD_JSON': not valid JSON (" in result.stderr
    assert "quote it for the shell" in result.stderr
    assert "Traceback" not in result.stderr

    # A usage error is the parser's text in --json mode too, as for an unknown option.
    as_json = cli(project, "--json", "trigger", "emails.welcome", "{bad")
    assert (as_json.returncode, as_json.stderr) == (2, result.stderr)


def test_unknown_task_is_reported_with_its_code(project: Path) -> None:
    result = cli(project, "--json", "trigger", "nope.task")
    assert result.returncode == 1
    # The last stderr line is the error; the local lane without `runlane dev` is warned about before it.
    assert json.loads(result.stderr.splitlines()[-1])["error"]["code"] == "task_not_found"


def test_a_task_with_no_queue_to_run_on_names_the_option_that_gives_it_one(tmp_path: Path) -> None:
    tasks = """
    from runlane import queue, task

    reports = queue("reports")


    @task("reports.build")
    def build(payload: dict) -> None:
        return None
    """
    project = make_project(tmp_path, tasks)
    result = cli(project, "trigger", "reports.build", "{}")
    assert result.returncode == 1
    assert "error[configuration_invalid]: Task 'reports.build' has no queue" in result.stderr
    assert "(--queue on the command line)" in result.stderr
    assert "Traceback" not in result.stderr
    given = cli(project, "--json", "trigger", "reports.build", "{}", "--queue", "reports")
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["run"]["queue"] == "reports"


def test_missing_config_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    result = cli(tmp_path, "tick")
    assert result.returncode == 1
    assert result.stderr.startswith("error[configuration_invalid]: No runlane.toml")
    explicit = cli(tmp_path, "-c", "missing.toml", "tick")
    assert explicit.returncode == 1
    assert "does not exist" in explicit.stderr


def test_prune_rejects_ambiguous_dates_before_loading_a_runtime(tmp_path: Path) -> None:
    # No config exists here: the date is rejected first, so the error is about the date.
    result = cli(tmp_path, "--json", "prune", "--older-than", "05/01/2026")
    assert result.returncode == 2
    assert "Error: Invalid value for '--older-than': '05/01/2026'" in result.stderr


@pytest.mark.parametrize(
    ("cutoff", "message"),
    [
        ("0s", "'0s' is not valid: it must be positive."),
        ("30 d", "'30 d' is not valid: use a number with a unit, such as"),
        ("last week", "'last week' is neither a duration (30d, 12h) nor an ISO 8601 date or date-time"),
    ],
)
def test_prune_says_what_is_wrong_with_a_cutoff_meant_as_a_duration(shared: Shared, cutoff: str, message: str) -> None:
    result = shared("prune", "--older-than", cutoff)
    assert result.exit_code == 2
    assert f"Error: Invalid value for '--older-than': {message}" in result.stderr


FAILING_TASKS = """
from runlane import Retry, queue, task

jobs = queue("jobs", default=True)


@task("jobs.flaky", queue=jobs, retry=Retry(2, backoff="1ms"))
def flaky(payload: dict) -> None:
    raise RuntimeError("smtp is down")
"""


def test_worker_commands_print_failed_attempts_with_their_traceback(tmp_path: Path) -> None:
    project = make_project(tmp_path, FAILING_TASKS, lane="sqlite")
    run_id = json.loads(cli(project, "--json", "trigger", "jobs.flaky", "{}").stdout)["run"]["id"]

    # The retry is due 1 ms later, so the same drain runs both attempts.
    human = cli(project, "dev", "--once")
    assert human.returncode == 0, human.stderr
    assert f"run retrying {run_id}" in human.stdout and f"run failed {run_id}" in human.stdout
    # The run's line says why and what next, so the stdout alone tells the story.
    assert re.search(rf"run retrying {run_id} .* attempts=1 error=task_failed retry_at=\S+Z$", human.stdout, re.M)
    assert re.search(rf"run failed {run_id} .* attempts=2 error=task_failed$", human.stdout, re.M)
    prefix = rf"^\S+Z (warning|error) Run {run_id} \(task jobs.flaky\): attempt "
    lines = re.findall(prefix + r"(\d) failed with task_failed \(Task failed\.\); (.*)$", human.stderr, re.MULTILINE)
    assert [(level, attempt) for level, attempt, _ in lines] == [("warning", "1"), ("error", "2")], human.stderr
    assert re.fullmatch(r"retry at \S+Z\.", lines[0][2]) and lines[1][2] == "the run has failed."
    assert human.stderr.count("Traceback (most recent call last):") == 2
    assert human.stderr.count("RuntimeError: smtp is down") == 2

    other = json.loads(cli(project, "--json", "trigger", "jobs.flaky", "{}").stdout)["run"]["id"]
    as_json = cli(project, "--json", "dev", "--once")
    assert as_json.returncode == 0, as_json.stderr
    assert [record["run"]["status"] for record in ndjson(as_json.stdout) if record["type"] == "run"] == [
        "retrying", "failed"
    ]
    logs = ndjson(as_json.stderr)
    assert [(log["type"], log["level"], log["logger"]) for log in logs] == [
        ("log", "warning", "runlane.task"), ("log", "error", "runlane.task")
    ]
    assert [(log["run_id"], log["task_id"], log["attempt"], log["error_code"]) for log in logs] == [
        (other, "jobs.flaky", 1, "task_failed"), (other, "jobs.flaky", 2, "task_failed")
    ]
    assert logs[1]["message"].endswith("attempt 2 failed with task_failed (Task failed.); the run has failed.")
    assert all(log["exception"].endswith("RuntimeError: smtp is down") for log in logs)

    # History keeps the sanitized failure only.
    shown = json.loads(cli(project, "--json", "runs", "get", run_id, "--events").stdout)
    assert shown["run"]["failure"]["message"] == "Task failed." and "smtp is down" not in json.dumps(shown)


def test_worker_commands_leave_logs_to_an_application_that_configured_logging(tmp_path: Path) -> None:
    tasks = "import logging\nlogging.basicConfig(format='APP %(name)s %(levelname)s %(message)s')\n" + FAILING_TASKS
    project = make_project(tmp_path, tasks, lane="sqlite")
    assert cli(project, "trigger", "jobs.flaky", "{}").returncode == 0
    result = cli(project, "dev", "--once")
    assert result.returncode == 0, result.stderr
    app_format = r"^APP runlane.task WARNING Run run_\w+ \(task jobs.flaky\): attempt 1 failed"
    assert re.search(app_format, result.stderr, re.MULTILINE), result.stderr
    assert " warning Run " not in result.stderr


def test_usage_errors_exit_2(project: Path) -> None:
    assert cli(project, "trigger").returncode == 2
    assert cli(project, "runs", "list", "--status", "bogus").returncode == 2
    assert cli(project, "no-such-command").returncode == 2
    assert cli(project, "prune").returncode == 2


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "the path is empty; give the path of a runlane.toml, or leave -c out"),
        ("sub", "'sub' is a directory; give the path of a config file in it (sub/runlane.toml)"),
    ],
)
def test_a_config_path_that_cannot_name_a_file_is_a_usage_error(project: Path, value: str, says: str) -> None:
    (project / "sub").mkdir()
    done = cli(project, "-c", value, "runs", "list")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"Error: Invalid value for '-c' / '--config': {says}" in done.stderr


# ---------------------------------------------------------------------------------------------
# In process: one SQLite file behind a runtime factory

RUNTIME_MODULE = """
from runlane import Retry, create_runlane, queue, task
from runlane_local import sqlite_lane

DATABASE = {database!r}
emails = queue("emails", default=True)
other = queue("other", concurrency_limit=2)


@task("emails.welcome", queue=emails, idempotency_key=lambda p: f"welcome.{p['user_id']}")
def send_welcome(payload: dict) -> dict:
    return {"sent": payload["user_id"]}


@task("emails.broken", queue=emails, retry=Retry(max_attempts=1))
def broken(payload: dict) -> None:
    raise RuntimeError("smtp down")


@task("emails.digest", queue=emails)
def digest(payload: list[str]) -> None:
    return None


def make_runtime():
    lane = sqlite_lane(DATABASE)
    tasks = [send_welcome, broken, digest]
    return create_runlane(lane=lane, queues=[emails, other], tasks=tasks, environment="test")
"""


class Shared:
    """Invoke the app in process against a project whose runtime factory opens one SQLite file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.module = f"cli_shared_{uuid.uuid4().hex}"
        write(root / f"{self.module}.py", RUNTIME_MODULE.replace("{database!r}", repr(str(root / "runlane.db"))))
        write(root / "runlane.toml", f'[runlane]\nruntime = "{self.module}:make_runtime"\n')
        self.runner = CliRunner()

    def __call__(self, *args: str) -> Any:
        return self.runner.invoke(app, ["-c", str(self.root / "runlane.toml"), *args])

    def json(self, *args: str) -> Any:
        result = self("--json", *args)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return json.loads(result.stdout)

    def ndjson(self, *args: str) -> list[dict[str, Any]]:
        result = self("--json", *args)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return ndjson(result.stdout)


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Shared:
    monkeypatch.setattr(sys, "path", list(sys.path))
    return Shared(tmp_path)


def test_trigger_created_then_returned_existing(shared: Shared) -> None:
    created = shared.json("trigger", "emails.welcome", '{"user_id": "u1"}', "--meta", '{"source": "cli"}')
    assert created["outcome"] == "created"
    run = created["run"]
    assert run["task_id"] == "emails.welcome" and run["status"] == "queued" and run["queue"] == "emails"
    assert run["payload"] == {"user_id": "u1"}
    assert run["environment"] == {"name": "test"}

    again = shared.json("trigger", "emails.welcome", '{"user_id": "u1"}')
    assert again["outcome"] == "returned_existing"
    assert again["run"]["id"] == run["id"]

    human = shared("trigger", "emails.welcome", '{"user_id": "u1"}')
    assert human.exit_code == 0
    assert f"⊝ returned existing {run['id']} (idempotency)" in human.stdout
    # Still queued: rerun (finished runs only) would be refused, so the hint says how to follow it.
    assert f"the run is still queued; runlane runs get {run['id']} follows it" in human.stdout
    assert "rerun" not in human.stdout

    assert shared("work", "--drain").exit_code == 0
    finished = shared("trigger", "emails.welcome", '{"user_id": "u1"}')
    assert f"use runlane rerun {run['id']} to execute this work again" in finished.stdout


def test_trigger_with_a_delay_or_a_start_time_waits_for_it(shared: Shared) -> None:
    later = shared.json("trigger", "emails.welcome", '{"user_id": "u9"}', "--delay", "2h")["run"]
    assert later["status"] == "queued" and later["run_at"] > later["created_at"]
    dated = shared.json("trigger", "emails.welcome", '{"user_id": "u8"}', "--run-at", "2099-01-01T09:30")["run"]
    assert dated["run_at"].startswith("2099-01-01T09:30:00") and dated["run_at"].endswith("Z")  # UTC, as said
    assert shared("work", "--drain").exit_code == 0
    assert shared.json("runs", "get", later["id"])["run"]["status"] == "queued"  # not due: left alone
    both = shared("trigger", "emails.welcome", '{"user_id": "u7"}', "--delay", "1h", "--run-at", "2099-01-01")
    assert both.exit_code == 2 and "--delay and --run-at do not go together" in both.stderr


def test_runs_wait_shows_the_finished_run_with_an_exit_status_that_says_how_it_ended(shared: Shared) -> None:
    welcome = shared.json("trigger", "emails.welcome", '{"user_id": "w1"}')["run"]
    broken = shared.json("trigger", "emails.broken", "{}")["run"]
    # Not run yet: the wait ends at --timeout with exit status 4 and shows the run as it is.
    waited = shared("--json", "runs", "wait", welcome["id"], "--timeout", "50ms")
    assert waited.exit_code == 4, waited.stderr
    assert json.loads(waited.stdout)["run"]["status"] == "queued"
    assert json.loads(waited.stderr.splitlines()[0])["warning"]["code"] == "wait_timed_out"
    human = shared("runs", "wait", welcome["id"], "--timeout", "50ms")
    assert human.exit_code == 4 and f"run {welcome['id']} is still queued after 50ms" in human.stderr
    assert shared("work", "--drain").exit_code == 0
    done = shared("--json", "runs", "wait", welcome["id"])
    assert done.exit_code == 0 and json.loads(done.stdout)["run"]["output"] == {"sent": "w1"}
    failed = shared("runs", "wait", broken["id"], "--timeout", "5s")
    assert failed.exit_code == 3 and failed.stdout.splitlines()[0] == broken["id"]
    assert "failed" in failed.stdout
    missing = shared("runs", "wait", "run_missing")
    assert missing.exit_code == 1 and missing.stderr.startswith("error[run_not_found]: Run run_missing")
    bad = shared("runs", "wait", welcome["id"], "--timeout", "soon")
    assert bad.exit_code == 2 and "--timeout" in bad.stderr


def test_trigger_at_dash_reads_a_file_named_dash_and_says_how_to_read_standard_input(tmp_path: Path) -> None:
    # curl spells standard input @-; here @PATH is always a path, and - alone is standard input.
    root = make_project(tmp_path / "proj", lane="sqlite")
    missing = cli(root, "trigger", "emails.welcome", "@-")
    assert missing.returncode == 2 and "could not read '-' (No such file or directory)" in missing.stderr
    assert "To read standard input, pass - alone (without the @)." in missing.stderr, missing.stderr
    (root / "-").write_text('{"user_id": "dash"}', encoding="utf-8")
    from_file = cli(root, "--json", "trigger", "emails.welcome", "@-")
    assert json.loads(from_file.stdout)["run"]["payload"] == {"user_id": "dash"}, from_file.stderr


def test_trigger_reads_its_payload_and_meta_from_standard_input_or_a_file(tmp_path: Path) -> None:
    # A payload larger than one command-line argument may be (128 KiB on Linux), or one a program wrote.
    from cli_support import RUNLANE, cli_env

    root = make_project(tmp_path / "proj", lane="sqlite")
    large = {"user_id": "u" * 200_000}
    (root / "payload.json").write_text(json.dumps(large), encoding="utf-8")

    def trigger(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        command = [RUNLANE, "--json", "trigger", "emails.welcome", *args]
        return subprocess.run(
            command, cwd=root, input=stdin, capture_output=True, text=True, timeout=60, env=cli_env()
        )

    from_file = trigger("@payload.json", "--meta", '{"via": "file"}')
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["run"]["payload"] == large
    (root / "meta.json").write_text('{"via": "stdin"}', encoding="utf-8")
    from_stdin = trigger("-", "--meta", "@meta.json", stdin='{"user_id": "Zoë"}')
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert json.loads(from_stdin.stdout)["run"]["payload"] == {"user_id": "Zoë"}
    stdin_run = json.loads(from_stdin.stdout)["run"]["id"]
    shown = json.loads(cli(root, "--json", "runs", "get", stdin_run, "--events").stdout)
    assert shown["events"]["data"][0]["event"]["meta"] == {"via": "stdin"}
    meta_from_stdin = trigger('{"user_id": "u3"}', "--meta", "-", stdin='{"via": "pipe"}')
    assert meta_from_stdin.returncode == 0, meta_from_stdin.stderr

    both = trigger("-", "--meta", "-", stdin="{}")
    assert both.returncode == 2 and "cannot read standard input: " in both.stderr
    missing = trigger("@nowhere.json")
    assert missing.returncode == 2 and "could not read 'nowhere.json' (No such file or directory)" in missing.stderr
    # A file name is quoted as Python writes a string: a newline or escape sequence in it reaches no terminal.
    hostile = trigger("@nowhere\x1b]0;title\x07\nfake: line")
    assert hostile.returncode == 2 and "'nowhere\\x1b]0;title\\x07\\nfake: line'" in hostile.stderr
    assert "\x1b" not in hostile.stderr
    (root / "latin1.json").write_bytes(b'{"user_id": "\xe9"}')
    undecodable = trigger("@latin1.json")
    assert undecodable.returncode == 2 and "'latin1.json': it is not UTF-8 text" in undecodable.stderr
    (root / "bom.json").write_bytes(b'\xef\xbb\xbf{"user_id": "bom"}')  # as some editors save it
    assert json.loads(trigger("@bom.json").stdout)["run"]["payload"] == {"user_id": "bom"}
    not_json = trigger("-", stdin="not json")
    assert not_json.returncode == 2 and "not valid JSON" in not_json.stderr
    for stdin in ("", "\n"):  # an empty pipe is not a shell quoting problem: say what was read
        empty = trigger("-", stdin=stdin)
        assert empty.returncode == 2 and "read nothing from standard input" in empty.stderr, empty.stderr
    (root / "empty.json").write_text("", encoding="utf-8")
    empty = trigger("@empty.json")
    assert empty.returncode == 2 and "read nothing from 'empty.json': the file is empty" in empty.stderr
    # An endless source (a device, a log of gigabytes named by mistake) is not read whole into memory.
    endless = trigger("@/dev/zero")
    assert endless.returncode == 2 and "read more than 64 MiB from '/dev/zero'" in endless.stderr, endless.stderr
    assert "pass the JSON value itself" in endless.stderr
    assert len(json.loads(cli(root, "--json", "runs", "list").stdout)["data"]) == 4  # nothing else was created


def test_runs_list_finds_runs_by_idempotency_or_singleton_key(shared: Shared) -> None:
    keyed = shared.json("trigger", "emails.welcome", '{"user_id": "k1"}')["run"]  # idempotency key welcome.k1
    single = shared.json("trigger", "emails.broken", "{}", "--singleton-key", "nightly")["run"]
    shared.json("trigger", "emails.welcome", '{"user_id": "k2"}')
    by_key = shared.json("runs", "list", "--idempotency-key", "welcome.k1")["data"]
    assert [run["id"] for run in by_key] == [keyed["id"]]
    assert [run["id"] for run in shared.json("runs", "list", "--singleton-key", "nightly")["data"]] == [single["id"]]
    assert shared.json("runs", "list", "--singleton-key", "other")["data"] == []
    bad = shared("runs", "list", "--idempotency-key", "a:b")
    assert bad.exit_code == 1 and "error[validation_failed]" in bad.stderr


def test_cancel_retry_and_rerun_take_several_runs_or_standard_input(tmp_path: Path) -> None:
    from cli_support import RUNLANE, cli_env

    root = make_project(tmp_path / "proj", lane="sqlite")

    def runlane(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [RUNLANE, "--json", *args], cwd=root, input=stdin, capture_output=True, text=True, timeout=60, env=cli_env()
        )

    triggered = [runlane("trigger", "emails.welcome", f'{{"user_id": "b{n}"}}') for n in range(4)]
    ids = [json.loads(result.stdout)["run"]["id"] for result in triggered]
    # Several on the command line, one of them unknown: the others are still cancelled, and the exit status says
    # that one failed; the results come one JSON document per line, the error on stderr.
    cancelled = runlane("cancel", ids[0], "run_missing", ids[1], "--reason", "bulk")
    assert cancelled.returncode == 1
    assert [json.loads(line)["run"]["id"] for line in cancelled.stdout.splitlines()] == [ids[0], ids[1]]
    assert json.loads(cancelled.stderr.splitlines()[-1])["error"]["code"] == "run_not_found"
    # From standard input, as a pipe from `runlane runs list` gives them.
    piped = runlane("cancel", "-", stdin=f"{ids[2]}\n\n{ids[3]}\n")
    assert piped.returncode == 0, piped.stderr
    statuses = {run["id"]: run["status"] for run in json.loads(runlane("runs", "list").stdout)["data"]}
    assert all(statuses[run_id] == "cancelled" for run_id in ids)
    reruns = runlane("rerun", *ids[:3])
    assert reruns.returncode == 0, reruns.stderr
    linked = [json.loads(line)["run"] for line in reruns.stdout.splitlines()]
    assert [run["source"]["source_run_id"] for run in linked] == ids[:3]
    assert runlane("rerun", ids[0], ids[1], "--run-id", "run_x").returncode == 2  # one new id for two runs
    assert runlane("cancel", "-", ids[0]).returncode == 2
    # A pipe that found no runs (no failed runs tonight) is nothing to do, not an error: cron stays quiet.
    nothing = runlane("retry", "-", stdin="\n")
    assert nothing.returncode == 0 and nothing.stdout == "", nothing.stderr
    assert json.loads(nothing.stderr)["warning"]["code"] == "no_run_ids"
    with_bom = runlane("rerun", "-", stdin=f"\ufeff{ids[3]}\n")  # as some tools write a file's start
    assert with_bom.returncode == 0, with_bom.stderr
    closed = subprocess.run(
        [RUNLANE, "cancel", "-"], cwd=root, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        env=cli_env(), preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert closed.returncode == 2 and "standard input, which is closed" in closed.stderr


def test_trigger_human_card_and_options(shared: Shared) -> None:
    result = shared(
        "trigger", "emails.welcome", '{"user_id": "u2"}', "--queue", "other", "--run-id", "run_cli_fixed",
        "--singleton-key", "s1", "--concurrency-key", "c1", "--actor-id", "ops@example.com",
    )
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "✓ created run_cli_fixed"
    card = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[1:])
    assert card["status"] == "queued"
    assert card["queue"] == "other"
    assert card["singleton key"] == "s1"
    assert card["concurrency key"] == "c1"
    run = shared.json("runs", "get", "run_cli_fixed", "--events")
    created = run["events"]["data"][0]["event"]
    assert created["type"] == "run.created"
    assert created["actor"] == {"type": "operator", "id": "ops@example.com"}


def test_trigger_without_a_payload_says_how_to_pass_one(shared: Shared) -> None:
    result = shared("trigger", "emails.welcome")
    assert result.exit_code == 1
    assert result.stderr.startswith("error[validation_failed]: Invalid payload for task 'emails.welcome'")
    assert result.stderr.rstrip().endswith(
        "The payload was null: pass it as JSON after the task id, as in: "
        "runlane trigger emails.welcome '{\"key\": \"value\"}'."
    )
    # The example has the JSON type the schema asks for.
    listed = shared("trigger", "emails.digest")
    assert listed.exit_code == 1
    assert listed.stderr.rstrip().endswith("as in: runlane trigger emails.digest '[\"value\"]'.")
    # A payload that was given but is wrong keeps the plain message.
    wrong = shared("trigger", "emails.welcome", '{"user": 1}')
    assert wrong.exit_code == 1 and "The payload was null" not in wrong.stderr
    assert shared.json("runs", "list")["data"] == []


def test_trigger_rejects_non_object_meta(shared: Shared) -> None:
    result = shared("trigger", "emails.welcome", '{"user_id": "u3"}', "--meta", "[1]")
    assert result.exit_code == 2
    assert "Error: Invalid value for '--meta': must be a JSON object" in result.stderr


def test_json_after_the_command_is_the_global_option_unless_it_follows_a_double_dash(shared: Shared) -> None:
    after = shared("trigger", "emails.welcome", '{"user_id": "u5"}', "--json")
    assert after.exit_code == 0, after.stderr
    run_id = json.loads(after.stdout)["run"]["id"]
    listed = shared("runs", "list", "--json")
    assert listed.exit_code == 0, listed.stderr
    assert [run["id"] for run in json.loads(listed.stdout)["data"]] == [run_id]
    failed = shared("runs", "get", "run_does_not_exist", "--json")
    assert failed.exit_code == 1
    assert json.loads(failed.stderr)["error"]["code"] == "run_not_found"

    literal = shared("trigger", "emails.welcome", "--", "--json")  # after "--" it is the payload argument
    assert literal.exit_code == 2
    assert "Error: Invalid value for 'PAYLOAD_JSON': not valid JSON" in literal.stderr


def test_runs_list_get_attempts_after_dev_once(shared: Shared) -> None:
    run_id = shared.json("trigger", "emails.welcome", '{"user_id": "u4"}')["run"]["id"]

    listed = shared.json("runs", "list", "--status", "queued", "--task", "emails.welcome", "--limit", "50")
    assert run_id in [summary["id"] for summary in listed["data"]]
    assert "next_cursor" in listed

    records = shared.ndjson("dev", "--once")
    executed = [record["run"] for record in records if record["type"] == "run"]
    assert [run["id"] for run in executed] == [run_id]

    detail = shared.json("runs", "get", run_id)
    assert set(detail) == {"run"}
    assert detail["run"]["status"] == "succeeded"
    assert detail["run"]["output"] == {"sent": "u4"}

    with_events = shared.json("runs", "get", run_id, "--events", "--limit", "2")
    sequences = [record["sequence"] for record in with_events["events"]["data"]]
    assert sequences == [1, 2]
    assert with_events["events"]["next_cursor"]
    rest = shared.json("runs", "get", run_id, "--events", "--cursor", with_events["events"]["next_cursor"])
    assert rest["events"]["data"][-1]["event"]["type"] == "run.succeeded"

    attempts = shared.json("runs", "attempts", run_id)
    assert attempts["run_id"] == run_id
    assert [(a["attempt"], a["status"]) for a in attempts["attempts"]] == [(1, "succeeded")]

    succeeded = shared.json("runs", "list", "--status", "succeeded", "--sort-by", "updated_at", "--sort-direction", "asc")
    assert run_id in [summary["id"] for summary in succeeded["data"]]
    future = shared.json("runs", "list", "--created-from", "2999-01-01")
    assert future["data"] == []

    table = shared("runs", "list")
    assert table.exit_code == 0 and run_id in table.stdout and "succeeded" in table.stdout
    card = shared("runs", "get", run_id, "--events")
    assert card.exit_code == 0
    assert card.stdout.splitlines()[0] == run_id
    assert "events" in card.stdout and "run.succeeded" in card.stdout


def test_runs_get_missing_run_is_run_not_found(shared: Shared) -> None:
    result = shared("--json", "runs", "get", "run_does_not_exist")
    assert result.exit_code == 1
    assert json.loads(result.stderr)["error"]["code"] == "run_not_found"
    human = shared("runs", "attempts", "run_does_not_exist")
    assert human.exit_code == 1
    assert human.stderr.startswith("error[run_not_found]:")


def test_runs_list_rejects_ambiguous_dates(shared: Shared) -> None:
    result = shared("runs", "list", "--created-from", "05/01/2026")
    assert result.exit_code == 2
    assert "Error: Invalid value for '--created-from': '05/01/2026' is not an ISO 8601 date" in result.stderr


@pytest.mark.parametrize("written", ["2026-11-30t20:29:58z", "2026-11-30T21:29:58+01", "2026-11-30 21:29:58+0100"])
def test_runs_list_reads_every_iso_8601_spelling_of_one_instant(shared: Shared, written: str) -> None:
    # RFC 3339 allows a lower-case t and z; ISO 8601 allows an offset of hours only.
    canonical = shared.json("runs", "list", "--created-from", "2026-11-30T20:29:58Z")
    assert shared.json("runs", "list", "--created-from", written) == canonical


def test_runs_list_date_alone_as_upper_bound_includes_that_whole_day(shared: Shared) -> None:
    run = shared.json("trigger", "emails.welcome", '{"user_id": "u_day"}')["run"]
    day = run["created_at"][:10]
    before = (datetime.fromisoformat(day) - timedelta(days=1)).date().isoformat()

    def listed(*bounds: str) -> list[str]:
        return [summary["id"] for summary in shared.json("runs", "list", "--limit", "500", *bounds)["data"]]

    assert run["id"] in listed("--created-from", day, "--created-to", day)
    assert run["id"] in listed("--updated-to", day)
    assert run["id"] not in listed("--created-to", before)
    # A date-time bound stays the instant it names.
    assert run["id"] not in listed("--created-to", f"{day}T00:00:00Z")


def test_retry_rerun_cancel_prune_and_signal(shared: Shared) -> None:
    failed_id = shared.json("trigger", "emails.broken", "{}")["run"]["id"]
    ok_id = shared.json("trigger", "emails.welcome", '{"user_id": "u5"}')["run"]["id"]
    shared.ndjson("dev", "--once")
    assert shared.json("runs", "get", failed_id)["run"]["status"] == "failed"

    retried = shared.json("retry", failed_id, "--run-id", "run_cli_retry", "--actor-id", "ops")["run"]
    assert retried["id"] == "run_cli_retry"
    assert retried["source"]["type"] == "manual_retry" and retried["source"]["source_run_id"] == failed_id

    rerun = shared.json("rerun", ok_id, "--queue", "other")["run"]
    assert rerun["queue"] == "other" and rerun["source"]["source_run_id"] == ok_id

    cancelled = shared.json("cancel", rerun["id"], "--reason", "operator_requested")["run"]
    assert cancelled["id"] == rerun["id"] and cancelled["status"] == "cancelled"

    human_retry = shared("retry", ok_id)
    assert human_retry.exit_code == 1  # a succeeded run cannot be retried, only rerun
    assert human_retry.stderr.startswith("error[")

    pruned = shared.json("prune", "--older-than", "2999-01-01T00:00:00Z", "--status", "cancelled", "--limit", "10")
    assert pruned["pruned"] >= 1
    assert shared("--json", "runs", "get", rerun["id"]).exit_code == 1

    signalled = shared.json("signal", "send", "nobody.waits", "--limit", "5")
    assert signalled == {"signal_key": "nobody.waits", "resumed": [], "runs": [], "more": False}


def test_prune_all_follows_every_cursor_and_leaves_none(shared: Shared) -> None:
    for n in range(7):
        shared.json("trigger", "emails.welcome", f'{{"user_id": "all{n}"}}')
    shared.ndjson("dev", "--once")
    one_page = shared.json("prune", "--older-than", "2999-01-01T00:00:00Z", "--limit", "2")
    assert one_page["pruned"] == 2 and one_page["next_cursor"] is not None

    every_page = shared.json("prune", "--older-than", "1ms", "--limit", "2", "--all")
    assert every_page == {"pruned": 5, "next_cursor": None}
    assert shared.json("runs", "list")["data"] == []
    human = shared("prune", "--older-than", "1ms", "--all")
    assert human.exit_code == 0 and human.stdout.strip() == "✓ pruned 0 runs"


def test_plugin_commands_are_registered_on_the_root_app() -> None:
    from runlane.cli.main import build_app
    from runlane.plugins import hookimpl
    from runlane.plugins.manager import pm

    class Plugin:
        @hookimpl
        def register_commands(self, app: Any) -> None:
            @app.command("hello")
            def hello() -> None:
                print("hello from a plugin")

    pm.register(Plugin(), name="test-cli-commands")
    try:
        result = CliRunner().invoke(build_app(), ["hello"])
    finally:
        pm.unregister(name="test-cli-commands")
    assert result.exit_code == 0
    assert result.stdout == "hello from a plugin\n"


def test_tick_every_is_a_maintenance_loop_that_stops_after_its_pass_on_sigterm(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")  # the default tasks carry a one-time schedule
    records, status, stderr = run_json_until(
        project, ["tick", "--every", "100ms"], lambda seen: sum(r["type"] == "tick" for r in seen) >= 3, signal.SIGTERM
    )
    assert status == 0, stderr
    assert records[0]["type"] == "tick_loop_started" and records[0]["every_seconds"] == 0.1
    ticks = [record["tick"] for record in records if record["type"] == "tick"]
    assert [tick["materialized"] for tick in ticks[:3]] == [1, 0, 0]  # the schedule's one run, once
    assert [record["type"] for record in records[-2:]] == ["stopping", "tick_loop_stopped"]
    assert records[-1]["passes"] == len(ticks)
    listed = json.loads(cli(project, "--json", "runs", "list").stdout)["data"]
    assert [run["source"]["type"] for run in listed] == ["schedule"]


SIGNALLED_TASKS = """
import asyncio

from runlane import queue, task

reports = queue("reports", default=True)


@task("reports.slow", queue=reports)
async def slow(payload: dict) -> None:
    await asyncio.sleep(0.3)
"""


LOGGING_TASKS = """
import logging
import warnings

from runlane import queue, task

default = queue("default", default=True)
log = logging.getLogger("app.billing")


@task("billing.charge")
def charge(payload: dict) -> None:
    log.warning("card declined for %s", payload["customer"])
    log.info("below the level Python shows when logging is not configured")
    if payload.get("deprecated"):
        warnings.warn("charge() without a currency is deprecated", UserWarning, stacklevel=1)
"""


def test_an_application_logger_with_a_handler_of_its_own_is_not_printed_twice(tmp_path: Path) -> None:
    tasks = LOGGING_TASKS.replace(
        'log = logging.getLogger("app.billing")',
        'log = logging.getLogger("app.billing")\n'
        'own = logging.StreamHandler()\n'
        'own.setFormatter(logging.Formatter("APP %(name)s: %(message)s"))\n'
        'logging.getLogger("app").addHandler(own)',
    )
    project = make_project(tmp_path, tasks, lane="sqlite")
    assert cli(project, "trigger", "billing.charge", '{"customer": "c1"}').returncode == 0
    drained = cli(project, "work", "--drain")
    assert drained.returncode == 0, drained.stderr
    assert drained.stderr.count("card declined for c1") == 1 and "APP app.billing: card declined" in drained.stderr


def test_a_workers_output_carries_the_applications_warnings_with_their_run(tmp_path: Path) -> None:
    # Logging not configured: the application's warnings come out as the worker's own lines do (JSON
    # objects under --json, not bare text among them), naming the run they were written for.
    project = make_project(tmp_path, LOGGING_TASKS, lane="sqlite")
    first = json.loads(cli(project, "--json", "trigger", "billing.charge", '{"customer": "c1"}').stdout)["run"]["id"]
    drained = cli(project, "--json", "work", "--drain")
    assert drained.returncode == 0, drained.stderr
    records = [json.loads(line) for line in drained.stderr.splitlines()]
    assert [(r["logger"], r["message"], r["run_id"], r["task_id"]) for r in records if r["type"] == "log"] == [
        ("app.billing", "card declined for c1", first, "billing.charge")
    ]
    cli(project, "trigger", "billing.charge", '{"customer": "c3", "deprecated": true}')
    warned = cli(project, "--json", "work", "--drain")
    lines = [json.loads(line) for line in warned.stderr.splitlines()]  # every line JSON, the warning too
    assert any("without a currency is deprecated" in line.get("message", "") for line in lines), warned.stderr
    second = json.loads(cli(project, "--json", "trigger", "billing.charge", '{"customer": "c2"}').stdout)["run"]["id"]
    human = cli(project, "work", "--drain")
    assert f"warning app.billing: card declined for c2 (run {second})" in human.stderr
    assert "below the level" not in human.stderr + human.stdout


PRINTING_TASKS = """
import subprocess
import sys
import threading

from runlane import queue, task

default = queue("default", default=True)


@task("report.print")
def report(payload: dict) -> None:
    print("report for", payload["customer"])
    print("no newline at the end", end="")
    print()
    subprocess.run([sys.executable, "-c", "print('from a child process')"], stdout=sys.stdout, check=True)
    subprocess.run([sys.executable, "-c", "print('from a child that inherits stdout')"], check=True)
    helper = threading.Thread(target=print, args=("from a thread of its own",))  # no run context
    helper.start()
    helper.join()
"""


@pytest.mark.parametrize("command", [["work", "--drain"], ["dev", "--once"]], ids=["work", "dev"])
def test_what_handlers_print_under_json_is_a_json_log_line_on_stderr_and_stdout_stays_json(
    tmp_path: Path, command: list[str]
) -> None:
    project = make_project(tmp_path, PRINTING_TASKS, lane="sqlite")
    run_id = json.loads(cli(project, "--json", "trigger", "report.print", '{"customer": "c1"}').stdout)["run"]["id"]
    drained = cli(project, "--json", *command)
    assert drained.returncode == 0, drained.stderr
    records = ndjson(drained.stdout)  # every stdout line is JSON: the run executed is among them
    assert [r["run"]["id"] for r in records if r["type"] == "run"] == [run_id]
    assert [r["run"]["status"] for r in records if r["type"] == "run"] == ["succeeded"]
    errors = drained.stderr.splitlines()
    printed = [json.loads(line) for line in errors if line.startswith("{")]
    prints = [(r["logger"], r["level"], r["message"], r.get("run_id")) for r in printed if r.get("logger") == "stdout"]
    assert prints == [
        ("stdout", "info", "report for c1", run_id),
        ("stdout", "info", "no newline at the end", run_id),
        ("stdout", "info", "from a thread of its own", None),
    ]
    assert "from a child process" in errors  # a child given sys.stdout writes beside the JSON, on stderr
    assert "from a child that inherits stdout" in errors  # so does one that inherits descriptor 1
    cli(project, "trigger", "report.print", '{"customer": "c2"}')
    human = cli(project, *command)
    assert "report for c2" in human.stdout.splitlines()  # without --json prints stay where print() puts them
    assert "from a child that inherits stdout" in human.stdout.splitlines()


FAILING_THREAD_TASKS = """
import threading

from runlane import queue, task

default = queue("default", default=True)


def fails() -> None:
    raise ValueError("the cache is gone")


@task("report.thread")
def report(payload: dict) -> str:
    helper = threading.Thread(target=fails, name="cache-refresh")
    helper.start()
    helper.join()
    return "done"
"""


@pytest.mark.parametrize("command", [["work", "--drain"], ["dev", "--once"]], ids=["work", "dev"])
def test_an_exception_ending_a_thread_a_handler_started_is_a_json_log_line_under_json(
    tmp_path: Path, command: list[str]
) -> None:
    """Python printed its traceback as bare lines among the JSON ones on stderr."""
    project = make_project(tmp_path, FAILING_THREAD_TASKS, lane="sqlite")
    cli(project, "trigger", "report.thread", "{}")
    drained = cli(project, "--json", *command)
    assert drained.returncode == 0, drained.stderr
    records = [json.loads(line) for line in drained.stderr.splitlines()]  # every line JSON
    (failed,) = [record for record in records if record.get("logger") == "threading"]
    assert failed["level"] == "error" and failed["message"] == "Exception in thread cache-refresh"
    assert "ValueError: the cache is gone" in failed["exception"]
    cli(project, "trigger", "report.thread", "{}")
    human = cli(project, *command)
    assert "ValueError: the cache is gone" in human.stderr  # without --json Python prints it as ever


def test_a_stop_signal_delivered_again_at_once_leaves_a_clean_stop_with_status_0(tmp_path: Path) -> None:
    # coreutils `timeout` (like a process manager) signals the process and then its group: the same stop
    # arrives twice, the second maybe once the worker has given back its signal handlers and is closing.
    # Repeats within SIGNAL_REPEAT_S of the first (here for 150 ms, every 5 ms, through the shutdown) are
    # that same stop: none may turn it into 130.
    from cli_support import RUNLANE, cli_env

    from runlane.cli.main import SIGNAL_REPEAT_S

    project = make_project(tmp_path, lane="sqlite")
    assert RUNLANE is not None and SIGNAL_REPEAT_S > 0.15
    process = subprocess.Popen(
        [RUNLANE, "--json", "work"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if json.loads(line)["type"] == "worker_started":
                break
        first = time.monotonic()
        while process.poll() is None and time.monotonic() - first < 0.15:
            process.send_signal(signal.SIGINT)
            time.sleep(0.005)
        rest, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    types = [record["type"] for record in ndjson(rest)]
    assert process.returncode == 0, (types, stderr)
    assert "stopping" in types and "exit" not in types, types


@pytest.mark.parametrize("command", [["work", "--drain"], ["dev", "--once"]], ids=["work-drain", "dev-once"])
def test_a_drain_a_stop_signal_ends_early_exits_with_the_signals_status(tmp_path: Path, command: list[str]) -> None:
    # A script must tell a drain that finished its due work (0) from one a deploy's SIGTERM cut short.
    project = make_project(tmp_path, SIGNALLED_TASKS, lane="sqlite")
    for n in range(3):
        assert cli(project, "trigger", "reports.slow", "{}", "--run-id", f"run_slow_{n}").returncode == 0
    records, status, stderr = run_json_until(
        project, command, lambda seen: any(r["type"] == "worker_started" for r in seen), signal.SIGTERM
    )
    assert status == 128 + signal.SIGTERM, stderr
    types = [r["type"] for r in records]
    assert "stopping" in types and types[-1] == "worker_stopped"
    statuses = [run["status"] for run in json.loads(cli(project, "--json", "runs", "list").stdout)["data"]]
    assert statuses.count("queued") >= 1  # due work was left
    finished = cli(project, "--json", *command)  # nothing stops this one: all of it runs, and it exits 0
    assert finished.returncode == 0, finished.stderr


def test_tick_every_refuses_a_bad_interval_and_a_process_local_lane(tmp_path: Path) -> None:
    bad = cli(make_project(tmp_path / "sqlite", lane="sqlite"), "tick", "--every", "forever")
    assert bad.returncode == 2 and "Error: Invalid value for '--every': 'forever' is not valid" in bad.stderr
    local = cli(make_project(tmp_path / "local"), "tick", "--every", "1s")
    assert local.returncode == 1
    assert "`runlane dev` already ticks that lane" in local.stderr


def test_dev_loop_ticks_executes_and_stops_cooperatively_on_sigint(project: Path) -> None:
    records, status, stderr = run_json_until(
        project,
        ["dev", "--tick-interval", "100ms"],
        lambda seen: sum(r["type"] == "tick" for r in seen) >= 2 and any(r["type"] == "run" for r in seen),
    )
    assert status == 0, stderr
    assert records[0]["type"] == "dev_started" and records[0]["process_local"] is True
    assert [r["run"]["status"] for r in records if r["type"] == "run"] == ["succeeded"]
    assert [r["type"] for r in records[-2:]] == ["stopping", "worker_stopped"]


BOUNDED_TASKS = """
from runlane import queue, task

default = queue("default", default=True)
gateway = queue("gateway", concurrency_limit=3)


@task("gateway.call", queue=gateway)
def call(payload: dict) -> None:
    return None
"""


def test_tick_dispatch_reservation_limit_bounds_the_reservations_of_one_pass(tmp_path: Path) -> None:
    root = make_project(tmp_path / "proj", BOUNDED_TASKS, lane="sqlite")
    for n in range(3):
        assert cli(root, "trigger", "gateway.call", json.dumps({"n": n})).returncode == 0
    limited = cli(root, "--json", "tick", "--dispatch-reservation-limit", "1")
    assert limited.returncode == 0, limited.stderr
    assert json.loads(limited.stdout)["tick"]["dispatch_reserved"] == 1
    rest = cli(root, "--json", "tick")
    assert json.loads(rest.stdout)["tick"]["dispatch_reserved"] == 2
    refused = cli(root, "tick", "--dispatch-reservation-limit", "0")
    assert refused.returncode == 2 and "--dispatch-reservation-limit" in refused.stderr


def test_a_lane_its_provider_refuses_to_build_is_reported_naming_the_config_file(tmp_path: Path) -> None:
    write(tmp_path / "app_tasks.py", "from runlane import queue\n\ndefault = queue('default', default=True)\n")
    write(tmp_path / "runlane.toml", '[runlane]\ntasks = ["app_tasks"]\n\n[lane]\nuse = "sqlite"\npath = ":memory:"\n')
    result = cli(tmp_path, "--json", "runs", "list")
    assert result.returncode == 1
    error = json.loads(result.stderr)["error"]
    assert error["message"].startswith("runlane.toml: The SQLite storage path must name a database file")
    assert error["meta"]["path"] == str((tmp_path / "runlane.toml").resolve())


def test_a_lane_option_mistake_in_pyproject_names_the_tool_runlane_table(tmp_path: Path) -> None:
    write(tmp_path / "app_tasks.py", "from runlane import queue\n\ndefault = queue('default', default=True)\n")
    write(
        tmp_path / "pyproject.toml",
        '[project]\nname = "app"\n\n[tool.runlane.runlane]\ntasks = ["app_tasks"]\n\n'
        '[tool.runlane.lane]\nuse = "sqlite"\npth = "runlane.db"\n',
    )
    result = cli(tmp_path, "--json", "runs", "list")
    assert result.returncode == 1
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "configuration_invalid" and error["meta"]["table"] == "[tool.runlane.lane]"
    assert error["message"].startswith("pyproject.toml: Invalid options in [tool.runlane.lane] for lane 'sqlite'")
    assert error["meta"]["path"] == str((tmp_path / "pyproject.toml").resolve())
    assert "'pth'" in error["message"]


@pytest.mark.parametrize("json_mode", [False, True], ids=["human", "json"])
def test_a_reader_that_stops_reading_ends_the_command_like_other_unix_tools(tmp_path: Path, json_mode: bool) -> None:
    # `runlane runs list | head -1`: the reader is gone before the result is written.
    from cli_support import RUNLANE, cli_env, make_project

    root = make_project(tmp_path / "proj", lane="sqlite")
    read, write = os.pipe()
    os.close(read)
    try:
        args = [RUNLANE, *(["--json"] if json_mode else []), "runs", "list"]
        done = subprocess.run(
            args, cwd=root, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, env=cli_env()
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == ""


@pytest.mark.parametrize("json_mode", [False, True], ids=["human", "json"])
def test_a_command_started_with_stderr_closed_keeps_its_result_and_status(tmp_path: Path, json_mode: bool) -> None:
    # `runlane ... 2>&-`: warnings (the local lane's) and errors go nowhere; the result still reaches stdout.
    from cli_support import RUNLANE, cli_env, make_project

    root = make_project(tmp_path / "proj")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [RUNLANE, *(["--json"] if json_mode else []), *args]
        return subprocess.run(
            command, cwd=root, stdout=subprocess.PIPE, text=True, timeout=60, env=cli_env(), pass_fds=(),
            preexec_fn=lambda: os.close(2),
        )  # fmt: skip

    listed = run("runs", "list")
    assert listed.returncode == 0
    assert (json.loads(listed.stdout) == {"data": [], "next_cursor": None}) if json_mode else listed.stdout
    missing = run("runs", "get", "run_missing")
    assert missing.returncode == 1 and missing.stdout == ""  # the error is not written to stdout instead


def test_an_ascii_locale_is_named_when_it_garbles_non_ascii_arguments(tmp_path: Path) -> None:
    # LC_ALL=C with Python's locale coercion and UTF-8 mode off: non-ASCII argument bytes become lone
    # surrogates, fine for a file name but not text a run id or payload can hold. The command says why.
    root = make_project(tmp_path / "proj", lane="sqlite")
    ascii_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    payload = '{"user_id": "Zoë"}'
    refused = cli(root, "trigger", "emails.welcome", payload, env=ascii_locale)
    assert refused.returncode == 1
    assert "warning: this process runs under an ASCII locale" in refused.stderr
    assert "LC_ALL=C.UTF-8" in refused.stderr and "PYTHONUTF8=1" in refused.stderr
    (root / "pàyload.json").write_text('{"user_id": "u1"}', encoding="utf-8")
    from_file = cli(root, "--json", "trigger", "emails.welcome", "@pàyload.json", env=ascii_locale)
    assert from_file.returncode == 0, from_file.stderr  # a file name is still found
    assert json.loads(from_file.stdout)["run"]["payload"] == {"user_id": "u1"}
    assert json.loads(from_file.stderr.splitlines()[0])["warning"]["code"] == "ascii_locale"
    assert cli(root, "trigger", "emails.welcome", payload).returncode == 0  # under the usual UTF-8 locale
    (root / "ünï.toml").write_text((root / "runlane.toml").read_text(), encoding="utf-8")
    listed = cli(root, "--json", "-c", "ünï.toml", "runs", "list", env=ascii_locale)  # a config file name too
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert len(json.loads(listed.stdout)["data"]) == 2


# Linux's /dev/full refuses every write with ENOSPC: a stdout on a full disk.
needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")


def into_a_full_disk(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed ``runlane`` in ``cwd`` with its stdout on ``/dev/full``."""
    from cli_support import RUNLANE, cli_env

    with open("/dev/full", "w") as full:
        return subprocess.run(
            [RUNLANE, *args], cwd=cwd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60, env=cli_env()
        )


@needs_dev_full
def test_a_result_that_cannot_be_written_says_the_command_finished(tmp_path: Path) -> None:
    from cli_support import cli, make_project

    root = make_project(tmp_path / "proj", lane="sqlite")
    done = into_a_full_disk(root, "trigger", "emails.welcome", '{"user_id": "u1"}')
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "the command finished, but its result could not be written to stdout (No space left on device)" in (
        done.stderr
    )
    done = into_a_full_disk(root, "--json", "trigger", "emails.welcome", '{"user_id": "u2"}')
    assert done.returncode == 1
    (error,) = [json.loads(line)["error"] for line in done.stderr.splitlines()]  # under --json, as JSON too
    assert error["code"] == "internal_error" and error["meta"] == {"reason": "No space left on device"}
    assert error["message"].startswith("The command finished, but its result could not be written to stdout")
    listed = json.loads(cli(root, "--json", "runs", "list").stdout)["data"]
    assert len(listed) == 2  # the runs were created: only the output was lost


@needs_dev_full
@pytest.mark.parametrize("args", [["-h"], ["runs", "list", "--help"], ["--version"]])
def test_help_or_version_that_cannot_be_written_fails_in_one_line(tmp_path: Path, args: list[str]) -> None:
    done = into_a_full_disk(tmp_path, *args)
    assert done.returncode == 1
    assert done.stderr == "error: the output could not be written (No space left on device).\n"
    done = into_a_full_disk(tmp_path, "--json", *args)
    assert done.returncode == 1
    assert json.loads(done.stderr)["error"]["message"] == "The output could not be written (No space left on device)."


# Put first on PYTHONPATH, this sitecustomize makes the process interrupt itself (as a Ctrl-C would) when it
# first imports the module named by RUNLANE_TEST_INTERRUPT_AT.
INTERRUPTING_SITECUSTOMIZE = """
import os, signal, sys

class InterruptAt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("RUNLANE_TEST_INTERRUPT_AT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAt())
"""


@pytest.mark.parametrize(
    "module",
    [
        "runlane.core.runtime",  # while the runlane package loads, before the command line exists
        "runlane_local",  # while the plugins load
    ],
)
def test_a_ctrl_c_while_the_command_starts_ends_it_without_a_traceback(tmp_path: Path, module: str) -> None:
    from cli_support import cli, make_project, write

    root = make_project(tmp_path / "proj", lane="sqlite")
    site = write(tmp_path / "site" / "sitecustomize.py", INTERRUPTING_SITECUSTOMIZE).parent
    done = cli(root, "runs", "list", env={"PYTHONPATH": str(site), "RUNLANE_TEST_INTERRUPT_AT": module})
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")
    assert cli(root, "runs", "list").stdout == "no runs\n"  # the same command, not interrupted


def test_a_result_cut_short_by_a_file_size_limit_is_not_reported_as_written(tmp_path: Path) -> None:
    # A short write (a file at its size limit, a nearly full disk) must not leave a cut result and exit 0.
    import resource

    from cli_support import RUNLANE, cli, cli_env, make_project

    root = make_project(tmp_path / "proj", lane="sqlite")
    created = cli(root, "--json", "trigger", "emails.welcome", json.dumps({"user_id": "u" * 100_000}))
    run_id = json.loads(created.stdout)["run"]["id"]

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    with open(tmp_path / "run.json", "w") as target:
        done = subprocess.run(
            [RUNLANE, "--json", "runs", "get", run_id], cwd=root, stdout=target, stderr=subprocess.PIPE, text=True,
            timeout=60, env=cli_env(), preexec_fn=limit_files,
        )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    error = json.loads(done.stderr)["error"]
    assert error["message"].startswith("The command finished, but its result could not be written to stdout")
    assert error["code"] == "internal_error" and error["meta"] == {"reason": "File too large"}


@pytest.mark.parametrize("json_mode", [False, True], ids=["human", "json"])
def test_stdout_that_cannot_encode_the_result_gets_it_escaped_after_the_change(tmp_path: Path, json_mode: bool) -> None:
    # A latin-1 or ASCII stdout: the trigger is saved, so failing now would make a retrying script trigger twice.
    from cli_support import cli, make_project

    root = make_project(tmp_path / "proj", lane="sqlite")
    args = [*(["--json"] if json_mode else []), "trigger", "emails.welcome", json.dumps({"user_id": "東京 😀"})]
    done = cli(root, *args, env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.isascii()
    if json_mode:
        assert json.loads(done.stdout)["run"]["payload"] == {"user_id": "東京 😀"}
    else:
        assert "\\u6771\\u4eac" in done.stdout  # escaped, not lost
    assert len(json.loads(cli(root, "--json", "runs", "list").stdout)["data"]) == 1


SLOW_TASKS = """
import time

from runlane import queue, task

default = queue("default", default=True)


@task("slow")
def slow(payload: dict) -> None:
    time.sleep(payload["seconds"])
"""


def test_a_worker_whose_reader_goes_away_stops_as_on_sigterm_and_leaves_no_run_running(tmp_path: Path) -> None:
    # `runlane work | head -2`: the attempts in flight finish and record their outcomes.
    from cli_support import RUNLANE, cli, cli_env, make_project

    root = make_project(tmp_path / "proj", tasks=SLOW_TASKS, lane="sqlite")
    for seconds in (0.1, 1, 1, 1, 1, 1):  # the first line comes while the others are still running
        assert cli(root, "trigger", "slow", json.dumps({"seconds": seconds})).returncode == 0
    pipeline = f"set -o pipefail; {shlex.quote(RUNLANE)} work --drain --concurrency 4 | head -2"
    done = subprocess.run(["bash", "-c", pipeline], cwd=root, capture_output=True, text=True, timeout=60, env=cli_env())
    assert done.returncode == 141, done.stderr
    assert "worker started" in done.stdout.splitlines()[0]
    statuses = {run["status"] for run in json.loads(cli(root, "--json", "runs", "list").stdout)["data"]}
    # No attempt cut short: one claimed as the worker stopped is handed back (released) without starting.
    assert statuses <= {"succeeded", "queued", "released"} and "succeeded" in statuses, statuses


def test_a_json_worker_whose_reader_went_away_still_stops_on_sigterm(tmp_path: Path) -> None:
    # `timeout 60 runlane --json work | head -1`: nothing to print until SIGTERM, whose `stopping` record
    # then finds the pipe closed; the worker must still stop (it hung, the error lost in the signal handler).
    from cli_support import RUNLANE, cli_env, make_project

    root = make_project(tmp_path / "proj", tasks=SLOW_TASKS, lane="sqlite")
    process = subprocess.Popen(
        [RUNLANE, "--json", "work"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env()
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        assert json.loads(process.stdout.readline())["type"] == "worker_started"
        process.stdout.close()  # the reader goes away
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 141
        assert b"Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
