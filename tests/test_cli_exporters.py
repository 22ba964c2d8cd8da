"""``[[exporters]]`` in ``runlane dev``: the installed console script in a subprocess inside a temporary project.

``dev --once`` exports once per configured exporter after its drain; the long-running form runs one
exporter loop per entry next to the worker and stops it cooperatively. Exporter names and options are
validated before anything starts.
"""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from cli_support import RUNLANE, cli, cli_env, make_project, ndjson, run_json_until

from runlane.core.observations import observation_record_id

CONSOLE_EXPORTER = """
[[exporters]]
use = "console"
consumer = "local_console"
"""


def is_observation(record: dict[str, Any]) -> bool:
    """Observation records carry a stream position and no lifecycle ``type``/``at``."""
    return "stream_position" in record and "type" not in record and "at" not in record


def add_exporter(project: Path, text: str = CONSOLE_EXPORTER) -> None:
    config = project / "runlane.toml"
    config.write_text(config.read_text(encoding="utf-8") + textwrap.dedent(text), encoding="utf-8")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with a scheduled task, configured through `runlane init config`."""
    return make_project(tmp_path)


def assert_run_observations(observations: list[dict[str, Any]], run: dict[str, Any]) -> None:
    """One observation per persisted event of ``run``, in order, with ids derived from their source."""
    assert len(observations) == run["event_sequence"]
    assert all(o["source_kind"] == "run_event" for o in observations)
    assert all(o["observation"]["run_id"] == run["id"] for o in observations)
    assert [o["observation"]["event_sequence"] for o in observations] == list(range(1, run["event_sequence"] + 1))
    types = [o["observation"]["event_type"] for o in observations]
    assert types[0] == "run.created" and types[-1] == "run.succeeded"
    positions = [int(o["stream_position"]) for o in observations]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    for record in observations:
        assert record["source_id"] == record["observation"]["event_id"]
        assert record["id"] == observation_record_id("default", "run_event", record["source_id"])
    assert len({o["id"] for o in observations}) == len(observations)


def test_dev_once_exports_one_observation_per_run_event(project: Path) -> None:
    add_exporter(project)
    result = cli(project, "--json", "dev", "--once")
    assert result.returncode == 0, result.stderr
    records = ndjson(result.stdout)
    lifecycle = [r for r in records if not is_observation(r)]
    observations = [r for r in records if is_observation(r)]
    assert [r["type"] for r in lifecycle] == ["tick", "worker_started", "run", "worker_stopped", "exported"]
    run = lifecycle[2]["run"]
    assert run["status"] == "succeeded"
    assert_run_observations(observations, run)
    assert lifecycle[-1]["exported"] == len(observations)
    assert lifecycle[-1]["exporter"] == "console" and lifecycle[-1]["consumer"] == "local_console"
    # The sink writes after the drain and before dev reports the export.
    assert records.index(observations[0]) > records.index(lifecycle[3])
    assert records.index(observations[-1]) < records.index(lifecycle[-1])


def test_dev_once_human_output_keeps_lifecycle_lines_apart_from_json_observations(project: Path) -> None:
    add_exporter(project)
    result = cli(project, "dev", "--once")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    lifecycle = [line for line in lines if not line.startswith("{")]
    observations = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(lifecycle) == 5
    assert all(line[:4].isdigit() and line[23] == "Z" for line in lifecycle)
    summary = f"exported {len(observations)} observation(s) exporter=console consumer=local_console"
    assert lifecycle[-1].endswith(summary)
    assert [o["observation"]["event_type"] for o in observations][::len(observations) - 1] == [
        "run.created",
        "run.succeeded",
    ]


def test_dev_once_console_exporter_can_write_to_stderr(project: Path) -> None:
    add_exporter(project, CONSOLE_EXPORTER + 'stream = "stderr"\n')
    result = cli(project, "--json", "dev", "--once")
    assert result.returncode == 0, result.stderr
    lifecycle = ndjson(result.stdout)
    assert not any(is_observation(r) for r in lifecycle)
    observations = ndjson(result.stderr)
    assert observations and all(is_observation(r) for r in observations)
    assert_run_observations(observations, lifecycle[2]["run"])


def test_dev_once_without_exporters_exports_nothing(project: Path) -> None:
    result = cli(project, "--json", "dev", "--once")
    assert result.returncode == 0, result.stderr
    assert [r["type"] for r in ndjson(result.stdout)] == ["tick", "worker_started", "run", "worker_stopped"]


def test_unknown_exporter_fails_before_anything_starts(project: Path) -> None:
    add_exporter(project, CONSOLE_EXPORTER.replace('"console"', '"consol"'))
    for args in (("dev", "--once"), ("dev", "--tick-interval", "100ms")):
        result = cli(project, *args, timeout=30)
        assert result.returncode == 1
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1
        assert lines[0].startswith(
            "error[configuration_invalid]: runlane.toml: Unknown exporter 'consol'; installed exporters: "
        )
        assert "console (plugin runlane.plugins.defaults)" in lines[0]


def test_misspelt_exporter_option_is_rejected_by_name(project: Path) -> None:
    add_exporter(project, CONSOLE_EXPORTER + 'streem = "stderr"\n')
    result = cli(project, "dev", "--once")
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        "error[configuration_invalid]: runlane.toml: Invalid options in [[exporters]] #1 for exporter 'console'"
    )
    assert "unknown key 'streem'" in lines[0] and "Allowed keys: stream" in lines[0]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (CONSOLE_EXPORTER + 'streem = "stderr"\n', "Invalid options in [[exporters]] #1 for exporter 'console'"),
        (CONSOLE_EXPORTER.replace('"console"', '"consol"'), "Unknown exporter 'consol'; installed exporters: "),
    ],
    ids=["misspelt-key", "unknown-use"],
)
def test_every_command_that_loads_the_config_rejects_a_broken_exporter_entry(
    tmp_path: Path, entry: str, message: str
) -> None:
    project = make_project(tmp_path, lane="sqlite")
    add_exporter(project, entry)
    commands = [
        ("runs", "list"), ("tick",), ("trigger", "emails.welcome", '{"user_id": "u1"}'), ("work", "--drain"),
        ("queues",), ("prune", "--older-than", "30d"), ("observations", "trim", "--older-than", "7d"),
    ]  # fmt: skip
    for args in commands:
        result = cli(project, *args, timeout=30)
        assert result.returncode == 1, args
        assert result.stdout == "", args
        # Named by its file first, as every error about the file's tables is.
        assert result.stderr.startswith(f"error[configuration_invalid]: runlane.toml: {message}"), (args, result.stderr)
    assert not (project / "runlane.db").exists()  # rejected before any lane was opened


def test_dev_loop_runs_exporters_beside_the_worker_and_stops_them_on_sigint(project: Path) -> None:
    add_exporter(project)
    records, status, stderr = run_json_until(
        project,
        ["dev", "--tick-interval", "100ms"],
        lambda seen: any(is_observation(r) and r["observation"]["event_type"] == "run.succeeded" for r in seen),
    )
    assert status == 0, stderr
    lifecycle = [r for r in records if not is_observation(r)]
    observations = [r for r in records if is_observation(r)]
    types = [r["type"] for r in lifecycle]
    assert types[0] == "dev_started"
    assert types.count("exporter_started") == 1 and types.count("exporter_stopped") == 1
    assert types.index("exporter_started") < types.index("worker_started")
    assert types[-3:] == ["stopping", "exporter_stopped", "worker_stopped"] or types[-3:] == [
        "stopping",
        "worker_stopped",
        "exporter_stopped",
    ]
    runs = [r["run"] for r in lifecycle if r["type"] == "run"]
    assert [run["status"] for run in runs] == ["succeeded"]
    assert_run_observations(observations, runs[0])
    stopped = next(r for r in lifecycle if r["type"] == "exporter_stopped")
    assert stopped["exported"] == len(observations) and stopped["consumer"] == "local_console"


def test_export_once_exports_what_is_pending_on_a_shared_lane_and_only_once(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")
    add_exporter(project)
    assert cli(project, "tick").returncode == 0  # materializes the scheduled run
    assert cli(project, "work", "--drain").returncode == 0
    run = json.loads(cli(project, "--json", "runs", "list").stdout)["data"][0]
    run = json.loads(cli(project, "--json", "runs", "get", run["id"]).stdout)["run"]

    first = cli(project, "--json", "export", "--once")
    assert first.returncode == 0, first.stderr
    # stdout carries the records alone, for whatever reads them; the command's own lines go to stderr.
    observations = ndjson(first.stdout)
    assert all(is_observation(r) for r in observations)
    assert_run_observations(observations, run)
    lifecycle = ndjson(first.stderr)
    assert [r["type"] for r in lifecycle] == ["exported"] and lifecycle[0]["exported"] == len(observations)

    again = cli(project, "--json", "export", "--once")  # the consumer's checkpoint moved past them
    assert again.returncode == 0, again.stderr
    assert again.stdout == ""
    assert ndjson(again.stderr) == [{**lifecycle[0], "at": ndjson(again.stderr)[0]["at"], "exported": 0}]
    human = cli(project, "export", "--once")
    assert human.stdout == "" and "exported 0 observation(s) exporter=console" in human.stderr


def test_export_once_runs_every_exporter_even_when_one_fails(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")
    add_exporter(
        project,
        """
        [[exporters]]
        use = "otlp"
        consumer = "collector"
        endpoint = "http://127.0.0.1:9/v1/logs"
        timeout = 1
        """,
    )
    add_exporter(project)  # the console exporter, after the failing one
    assert cli(project, "tick").returncode == 0
    result = cli(project, "--json", "export", "--once")
    assert result.returncode == 1
    assert ndjson(result.stdout) and all(is_observation(r) for r in ndjson(result.stdout))
    # stderr also holds what the OTLP exporter logged about the refused connection.
    *records, error = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [(r["type"], r["consumer"]) for r in records] == [
        ("exporter_failed", "collector"),
        ("exported", "local_console"),
    ]
    assert records[0]["error_code"] == "observation_export_failed" and records[1]["exported"] > 0
    assert error["error"]["code"] == "observation_export_failed"


def test_export_runs_until_sigterm_and_stops_its_exporters(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")
    add_exporter(project)
    assert cli(project, "tick").returncode == 0 and cli(project, "work", "--drain").returncode == 0
    records, status, stderr = run_json_until(
        project, ["export"], lambda seen: sum(is_observation(r) for r in seen) >= 5, signal.SIGTERM
    )
    assert status == 0, stderr
    assert all(is_observation(r) for r in records)  # stdout: the records alone
    lifecycle = ndjson(stderr)
    assert [r["type"] for r in lifecycle] == ["exporter_started", "stopping", "exporter_stopped"]
    assert lifecycle[-1]["exported"] == len(records)


def test_export_stops_its_console_exporter_when_the_reader_of_stdout_goes_away(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")
    add_exporter(project)
    assert cli(project, "tick").returncode == 0  # the scheduled run: records to export
    assert RUNLANE is not None
    process = subprocess.Popen(
        [RUNLANE, "export"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env()
    )
    watchdog = threading.Timer(60, process.kill)
    watchdog.start()
    try:
        assert process.stdout is not None
        assert is_observation(json.loads(process.stdout.readline()))
        process.stdout.close()  # `runlane export | head -1`: the reader has gone
        assert cli(project, "trigger", "emails.welcome", '{"user_id": "user_2"}').returncode == 0  # more to write
        stderr = process.communicate(timeout=30)[1]
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
    # The exporter stops, saying why, instead of writing into the closed pipe every 5 s for ever.
    assert process.returncode == 1, stderr
    assert "exporter failed exporter=console" in stderr and "closed by its reader" in stderr
    assert "Traceback" not in stderr


def test_export_needs_exporters_and_a_shared_lane(project: Path, tmp_path: Path) -> None:
    none = cli(make_project(tmp_path / "bare", lane="sqlite"), "export")
    assert none.returncode == 1 and none.stderr.startswith("error[configuration_invalid]: No [[exporters]]")
    add_exporter(project)  # the in-memory lane: only runlane dev holds its records
    local = cli(project, "export", "--once")
    assert local.returncode == 1 and "`runlane dev` runs the [[exporters]] of that lane" in local.stderr


def test_observations_trim_keeps_what_a_configured_exporter_has_not_exported(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")
    add_exporter(project)
    assert cli(project, "tick").returncode == 0 and cli(project, "work", "--drain").returncode == 0

    def trim(*args: str) -> dict[str, Any]:
        result = cli(project, "--json", "observations", "trim", "--older-than", "1ms", *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    assert trim("--all") == {"deleted": 0, "more": False}  # local_console has exported nothing yet
    exported = ndjson(cli(project, "--json", "export", "--once").stderr)[-1]["exported"]
    assert exported > 1
    assert trim("--limit", "1") == {"deleted": 1, "more": True}
    assert trim("--all") == {"deleted": exported - 1, "more": False}
    assert json.loads(cli(project, "--json", "runs", "list").stdout)["data"] != []  # run history is untouched

    human = cli(project, "observations", "trim", "--older-than", "soon")
    assert human.returncode == 2 and "Error: Invalid value for '--older-than': 'soon' is neither" in human.stderr


def test_export_and_dev_close_the_sinks_they_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import BaseModel, ConfigDict
    from typer.testing import CliRunner

    from runlane.cli.main import app
    from runlane.plugins import hookimpl
    from runlane.plugins.manager import pm
    from runlane.plugins.registries import ExporterProvider

    events: list[str] = []

    class Sink:
        async def export(self, records: Any) -> None:
            events.append(f"export {len(records)}")

        async def close(self) -> None:
            events.append("close")

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def create(options: Any, context: Any) -> Sink:
        events.append("create")
        return Sink()

    class Plugin:
        @hookimpl
        def register_exporters(self, register: Any) -> None:
            register(ExporterProvider("closing", Options, create))

    root = make_project(tmp_path / "proj", lane="sqlite")
    assert cli(root, "trigger", "emails.welcome", '{"user_id": "u1"}').returncode == 0
    add_exporter(root, '\n[[exporters]]\nuse = "closing"\nconsumer = "closing"\n')  # known in this process only
    monkeypatch.chdir(root)
    pm.register(Plugin(), name="test-closing-exporter")
    try:
        listed = CliRunner().invoke(app, ["runs", "list"])
        exported = CliRunner().invoke(app, ["export", "--once"])
        developed = CliRunner().invoke(app, ["dev", "--once"])
    finally:
        pm.unregister(name="test-closing-exporter")
    assert listed.exit_code == 0, listed.output
    assert exported.exit_code == 0, exported.output
    assert developed.exit_code == 0, developed.output
    # Commands that do not export check the entry's options but never build its sink.
    assert events[0] == "create" and events[1].startswith("export "), events
    assert events.count("create") == 2 and events.count("close") == 2 and events[-1] == "close"


def test_a_sink_whose_close_calls_sys_exit_is_logged_and_the_command_ends_as_it_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The SystemExit escaped close_sinks: runlane export --once ended with the sink's status 4, saying nothing.
    from pydantic import BaseModel, ConfigDict
    from typer.testing import CliRunner

    from runlane.cli.main import app
    from runlane.plugins import hookimpl
    from runlane.plugins.manager import pm
    from runlane.plugins.registries import ExporterProvider

    class Sink:
        async def export(self, records: Any) -> None:
            pass

        def close(self) -> None:
            raise SystemExit(4)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class Plugin:
        @hookimpl
        def register_exporters(self, register: Any) -> None:
            register(ExporterProvider("exiting", Options, lambda options, context: Sink()))

    root = make_project(tmp_path / "proj", lane="sqlite")
    add_exporter(root, '\n[[exporters]]\nuse = "exiting"\nconsumer = "exiting"\n')  # known in this process only
    monkeypatch.chdir(root)
    pm.register(Plugin(), name="test-exiting-exporter")
    try:
        exported = CliRunner().invoke(app, ["export", "--once"])
    finally:
        pm.unregister(name="test-exiting-exporter")
    assert exported.exit_code == 0, exported.output
    assert "exported 0 observation(s) exporter=exiting consumer=exiting" in exported.stdout
    assert "Closing exporter 'exiting' (consumer 'exiting') failed." in caplog.messages
