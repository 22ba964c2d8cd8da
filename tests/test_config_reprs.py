"""The reprs of a loaded configuration name a plugin's options without their values: after ``${VAR}``
expansion those hold connection strings, passwords and API keys, and a repr ends up in logs and tracebacks."""

from __future__ import annotations

from pathlib import Path

from cli_support import write

from runlane.config import ExporterConfig, LaneConfig, LoadedConfig, load_config

ENVIRON = {"DATABASE_URL": "postgresql://app:DbPassw0rd@db/app", "TELEMETRY_API_KEY": "k3y-Secret"}
SECRETS = ("DbPassw0rd", "k3y-Secret", "Inline-Pa55")
LANE = '[lane]\nuse = "postgres-polling"\nconnection_string = "${DATABASE_URL}"\nschema = "app"'


def _load(tmp_path: Path, lane: str) -> LoadedConfig:
    write(
        tmp_path / "runlane.toml",
        f"""
        [runlane]
        tasks = []

        {lane}

        [[exporters]]
        use = "otlp"
        consumer = "otel_logs"
        endpoint = "http://collector:4318/v1/logs"
        headers = {{ "x-api-key" = "${{TELEMETRY_API_KEY}}", "x-inline" = "Inline-Pa55" }}
        """,
    )
    loaded = load_config(cwd=tmp_path, environ=ENVIRON)
    assert loaded is not None
    return loaded


def _shown(*objects: object) -> str:
    return "\n".join(text for item in objects for text in (repr(item), str(item)))


def test_lane_and_exporter_options_are_named_without_their_values(tmp_path: Path) -> None:
    loaded = _load(tmp_path, LANE)
    lane, exporter = loaded.lane, loaded.exporters[0]
    assert lane is not None
    shown = _shown(loaded, loaded.config, loaded.source, lane, exporter, loaded.exporters)
    assert not [secret for secret in SECRETS if secret in shown], shown
    assert repr(lane) == "LaneConfig(use='postgres-polling', options={'connection_string': ..., 'schema': ...})"
    assert repr(exporter) == (
        "ExporterConfig(use='otlp', consumer='otel_logs', options={'endpoint': ..., 'headers': ...})"
    )
    # Only the reprs changed: the values, their order, equality and dumps are as before.
    assert lane.options == {"connection_string": ENVIRON["DATABASE_URL"], "schema": "app"}
    assert exporter.options["headers"] == {"x-api-key": "k3y-Secret", "x-inline": "Inline-Pa55"}
    assert list(lane.model_dump()) == ["use", "options"]
    assert list(exporter.model_dump()) == ["use", "consumer", "options"]
    assert loaded == _load(tmp_path, LANE)
    assert lane == LaneConfig.model_validate({"use": "postgres-polling", **lane.options})
    assert exporter != ExporterConfig.model_validate({"use": "otlp", "consumer": "otel_logs", "headers": {}})


def test_a_nested_lane_table_is_hidden_too(tmp_path: Path) -> None:
    loaded = _load(
        tmp_path,
        """
        [lane]
        use = "postgres-sqs"

        [lane.postgres]
        connection_string = "${DATABASE_URL}"

        [lane.sqs]
        queues = [{ name = "default", queue_url = "https://sqs.us-east-1.amazonaws.com/1/q" }]
        """,
    )
    assert loaded.lane is not None
    assert loaded.lane.options["postgres"] == {"connection_string": ENVIRON["DATABASE_URL"]}
    shown = _shown(loaded, loaded.config, loaded.lane)
    assert not [secret for secret in SECRETS if secret in shown], shown
    assert "options={'postgres': ..., 'sqs': ...}" in repr(loaded.lane)
