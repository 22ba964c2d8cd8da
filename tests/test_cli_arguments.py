"""How the ``runlane`` command line reads its arguments: options with several values, malformed values.

Each test runs the installed console script in a temporary SQLite project, so commands share state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from cli_support import cli, make_project, ndjson

from runlane.cli.main import build_app
from runlane.cli.options import MultiValueCommand

TWO_QUEUES = """
from runlane import Retry, queue, task

mail = queue("mail", default=True)
reports = queue("reports")


@task("mail.send", queue=mail)
def send(payload: dict) -> dict:
    return {"sent": True}


@task("reports.build", queue=reports, retry=Retry(max_attempts=1))
def build(payload: dict) -> None:
    raise RuntimeError("no data")
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path, TWO_QUEUES, lane="sqlite")


def _ids(result: object) -> set[str]:
    assert result.returncode == 0, result.stderr  # type: ignore[attr-defined]
    return {run["id"] for run in json.loads(result.stdout)["data"]}  # type: ignore[attr-defined]


def test_list_options_take_several_values_after_one_flag(project: Path) -> None:
    sent = json.loads(cli(project, "--json", "trigger", "mail.send", "{}").stdout)["run"]["id"]
    built = json.loads(cli(project, "--json", "trigger", "reports.build", "{}").stdout)["run"]["id"]

    # work, and dev --once, take the queues after one --queue.
    worked = cli(project, "--json", "work", "--drain", "--queue", "mail", "reports", "--concurrency", "1")
    assert worked.returncode == 0, worked.stderr
    started = ndjson(worked.stdout)[0]
    assert started["type"] == "worker_started" and started["queues"] == ["mail", "reports"]
    assert {(record["run"]["id"], record["run"]["status"]) for record in ndjson(worked.stdout)[1:-1]} == {
        (sent, "succeeded"), (built, "failed")
    }
    once = cli(project, "--json", "dev", "--once", "--queue", "mail", "reports")
    assert once.returncode == 0, once.stderr

    both = {sent, built}
    assert _ids(cli(project, "--json", "runs", "list", "--status", "succeeded", "failed")) == both
    assert _ids(cli(project, "--json", "runs", "list", "--status", "succeeded", "--status", "failed")) == both
    assert _ids(cli(project, "--json", "runs", "list", "--status", "queued", "--status", "succeeded", "failed")) == both
    assert _ids(cli(project, "--json", "runs", "list", "--task", "mail.send", "reports.build")) == both
    assert _ids(cli(project, "--json", "runs", "list", "--queue", "mail", "reports", "--limit", "10")) == both
    # The values end at the next option.
    assert _ids(cli(project, "--json", "runs", "list", "--status", "failed", "--task", "mail.send", "x")) == set()
    assert _ids(cli(project, "runs", "list", "--queue", "reports", "--json")) == {built}

    # The spec's own example.
    pruned = cli(project, "--json", "prune", "--older-than", "2999-01-01", "--status", "succeeded", "cancelled",
                 "--limit", "500")  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["pruned"] == 1
    assert _ids(cli(project, "--json", "runs", "list")) == {built}


def test_a_multi_value_option_still_needs_a_value_and_checks_each(project: Path) -> None:
    missing = cli(project, "runs", "list", "--status")
    assert missing.returncode == 2 and "Option '--status' requires an argument" in missing.stderr
    bogus = cli(project, "runs", "list", "--status", "failed", "bogus")
    assert bogus.returncode == 2 and "Invalid value for '--status'" in bogus.stderr


def test_init_config_takes_several_task_modules_after_one_flag(tmp_path: Path) -> None:
    result = cli(tmp_path, "init", "config", "--tasks", "app.tasks", "app.more", "--lane", "sqlite")
    assert result.returncode == 0, result.stderr
    assert 'tasks = ["app.tasks", "app.more"]' in (tmp_path / "runlane.toml").read_text()


def test_every_repeatable_option_takes_several_values_and_says_so() -> None:
    """A command with a list option uses MultiValueCommand (and so has no positional arguments)."""
    root = typer.main.get_command(build_app())

    def commands(group: object, path: str) -> list[tuple[str, object]]:
        found = []
        for name, command in getattr(group, "commands", {}).items():
            found.append((f"{path} {name}", command))
            found.extend(commands(command, f"{path} {name}"))
        return found

    checked = []
    for path, command in commands(root, "runlane"):
        for param in getattr(command, "params", []):
            if param.param_type_name == "option" and param.multiple and not param.is_flag:
                assert isinstance(command, MultiValueCommand), f"{path} {param.opts[0]}"
                assert "one or more values" in (param.help or ""), f"{path} {param.opts[0]}"
                checked.append(f"{path} {param.opts[0]}")
    assert {"runlane runs list --status", "runlane prune --status", "runlane work --queue", "runlane dev --queue",
            "runlane runs list --task", "runlane runs list --queue"} <= set(checked)  # fmt: skip


MALFORMED = [
    (("runs", "list", "--created-from", "05/01/2026"), "--created-from", "'05/01/2026' is not an ISO 8601 date"),
    (("runs", "list", "--run-at-to", "yesterday"), "--run-at-to", "'yesterday' is not an ISO 8601 date"),
    (("runs", "list", "--limit", "abc"), "--limit", "valid integer"),
    (("runs", "list", "--sort-by", "bogus"), "--sort-by", "'bogus'"),
    (("prune", "--older-than", "30x"), "--older-than", "'30x' is not valid: use a number with a unit"),
    # Only terminal runs can be pruned, so only terminal statuses are offered (in plain words).
    (("prune", "--status", "queued"), "--status", "Invalid value for '--status': 'queued' is not one of "
                                                  "'cancelled', 'failed', 'succeeded'."),
    (("observations", "trim", "--older-than", "0s"), "--older-than", "'0s' is not valid: it must be positive"),
    (("prune", "--older-than", "99999999d"), "--older-than", "'99999999d' reaches before the year 1"),
    (("observations", "trim", "--older-than", "99999999d"), "--older-than", "'99999999d' reaches before the year 1"),
    (("trigger", "mail.send", "not-json"), "PAYLOAD_JSON", "not valid JSON"),
    (("trigger", "mail.send", ""), "PAYLOAD_JSON", "an empty string: JSON needs a value"),
    (("trigger", "mail.send", "{}", "--meta", " "), "--meta", "an empty string: JSON needs a value"),
    (("trigger", "mail.send", "[" * 3000 + "]" * 3000), "PAYLOAD_JSON", "nested too deeply"),
    # Deeper than a payload may nest, though every Python release's parser reads it.
    (("trigger", "mail.send", '{"a": ' + "[" * 250 + "]" * 250 + "}"), "PAYLOAD_JSON", "at most 200 levels"),
    (("trigger", "mail.send", '{"n": ' + "1" * 5000 + "}"), "PAYLOAD_JSON", "a number too long to read"),
    (("runs", "list", "--created-from", "0001-01-01T00:00:00+01:00"), "--created-from", "is not a valid date"),
    (("runs", "list", "--updated-to", "9999-12-31T23:59:59-01:00"), "--updated-to", "is not a valid date"),
    (("trigger", "mail.send", "{}", "--run-at", "2030-01-01T00:00+99:00"), "--run-at", "offset must be less than 24"),
    (("trigger", "mail.send", '{"n": NaN}'), "PAYLOAD_JSON", "NaN is not a JSON value (JSON has no NaN or Infinity)"),
    (("trigger", "mail.send", "{}", "--meta", "[1]"), "--meta", "must be a JSON object"),
    (("trigger", "mail.send", "{}", "--idempotency-key-ttl", "forever"), "--idempotency-key-ttl", "use 'active' or"),
    (("tick", "--every", "5x"), "--every", "'5x' is not valid"),
    (("work", "--lease-duration", "soon"), "--lease-duration", "'soon' is not valid"),
    (("work", "--empty-poll-delay", "-1s"), "--empty-poll-delay", "'-1s' is not valid"),
    (("dev", "--tick-interval", "fast"), "--tick-interval", "'fast' is not valid"),
    # An unset shell variable must not record an anonymous operator.
    (("trigger", "mail.send", "{}", "--actor-id", ""), "--actor-id", "must not be empty; omit it"),
    (("cancel", "run_1", "--actor-id", " "), "--actor-id", "must not be empty; omit it"),
]


@pytest.mark.parametrize(("args", "flag", "problem"), MALFORMED, ids=[" ".join(case[0])[:60] for case in MALFORMED])
def test_a_malformed_value_is_a_usage_error_naming_its_option(
    project: Path, args: tuple[str, ...], flag: str, problem: str
) -> None:
    for json_mode in (False, True):
        result = cli(project, *(["--json"] if json_mode else []), *args, timeout=30)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stdout == ""
        assert f"Try 'runlane {args[0]}" in result.stderr  # Click's usage hint, as for an unknown option
        assert f"Error: Invalid value for '{flag}': " in result.stderr and problem in result.stderr, result.stderr
        assert "error[" not in result.stderr and "Traceback" not in result.stderr


COMBINATIONS = [
    (("work", "--max-runs", "3"), "--max-runs applies only with --drain."),
    (("work", "--drain", "--empty-poll-delay", "1s"), "--empty-poll-delay applies only without --drain."),
    (("dev", "--max-runs", "3"), "--max-runs applies only with --once."),
    (("dev", "--once", "--empty-poll-delay", "1s"), "--empty-poll-delay applies only without --once."),
    (("runs", "list", "--created-from", "2026-05-02", "--created-to", "2026-05-01"), "--created-from is after"),
    (("trigger", "mail.send", "{}", "--delay", "5s", "--run-at", "2030-01-01"), "--delay and --run-at do not go"),
    (("dev", "--once", "--tick-interval", "1s"), "--tick-interval applies only without --once"),
    (("work", "--heartbeat-interval", "10m", "--lease-duration", "1m"), "--heartbeat-interval 10m must be shorter"),
    (("work", "--heartbeat-interval", "60s", "--lease-duration", "1m"), "--heartbeat-interval 60s must be shorter"),
    (("sqs", "consume", "--heartbeat-interval", "2m", "--lease-duration", "1m"), "--heartbeat-interval 2m must be"),
]


@pytest.mark.parametrize(("args", "problem"), COMBINATIONS, ids=[" ".join(case[0]) for case in COMBINATIONS])
def test_options_that_do_not_go_together_are_a_usage_error(project: Path, args: tuple[str, ...], problem: str) -> None:
    result = cli(project, *args, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and f"Error: {problem}" in result.stderr


def test_errors_found_by_the_runtime_keep_exit_status_1(project: Path) -> None:
    missing = cli(project, "--json", "runs", "get", "run_missing")
    assert missing.returncode == 1 and json.loads(missing.stderr)["error"]["code"] == "run_not_found"
    unknown = cli(project, "work", "--drain", "--queue", "nosuch")
    assert unknown.returncode == 1 and unknown.stderr.startswith("error[configuration_invalid]: Queue 'nosuch'")


def test_older_than_names_both_forms_it_takes_for_a_value_that_is_neither(project: Path) -> None:
    result = cli(project, "prune", "--older-than", "05/01/2026")
    assert result.returncode == 2
    assert (
        "Error: Invalid value for '--older-than': '05/01/2026' is neither a duration (30d, 12h) "
        "nor an ISO 8601 date or date-time (2026-05-01, 2026-05-01T00:00:00Z)."
    ) in result.stderr
    # A value meant as a duration still hears what is wrong with it as one.
    assert "'30x' is not valid: use a number with a unit" in cli(project, "prune", "--older-than", "30x").stderr


def test_runs_get_pages_events_only_with_events(project: Path) -> None:
    run_id = json.loads(cli(project, "--json", "trigger", "mail.send", "{}").stdout)["run"]["id"]
    for args in (("--cursor", "abc"), ("--limit", "5")):
        result = cli(project, "runs", "get", run_id, *args)
        assert result.returncode == 2 and result.stdout == ""
        assert "Error: --cursor and --limit page the event history: pass them with --events." in result.stderr
    paged = cli(project, "--json", "runs", "get", run_id, "--events", "--limit", "1")
    assert paged.returncode == 0, paged.stderr
    assert len(json.loads(paged.stdout)["events"]["data"]) == 1


def test_init_config_given_a_directory_or_an_unwritable_place_says_so(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for extra in ((), ("--overwrite",)):
        result = cli(tmp_path, "init", "config", "--path", "sub", *extra)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr.startswith("error[configuration_invalid]: sub is a directory; give --path the file")
    assert list((tmp_path / "sub").iterdir()) == []
    unwritable = cli(tmp_path, "init", "config", "--path", "/proc/runlane.toml")
    assert unwritable.returncode == 1 and "Cannot write /proc/runlane.toml: No such file" in unwritable.stderr
    assert ".tmp" not in unwritable.stderr


def test_init_config_accepts_only_an_installed_lane(tmp_path: Path) -> None:
    result = cli(tmp_path, "init", "config", "--lane", "nosuch")
    assert result.returncode == 2
    assert "Error: Invalid value for '--lane': Unknown lane 'nosuch'; installed lanes: " in result.stderr
    assert "local (plugin " in result.stderr and "sqlite (plugin " in result.stderr
    assert not (tmp_path / "runlane.toml").exists()
