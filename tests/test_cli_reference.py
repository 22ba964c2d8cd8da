"""docs/cli.md is generated from the commands' own --help texts; it must match them."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from runlane.cli.main import build_app
from runlane.cli.reference import command_paths, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_cli_reference_is_current() -> None:
    expected = render()
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/cli.md is out of date: regenerate it with `python -m runlane.cli.reference > docs/cli.md`"
    )


def test_cli_reference_covers_every_command() -> None:
    text = render()
    for command in ("init config", "dev", "work", "tick", "trigger", "runs list", "runs get", "runs attempts",
                    "retry", "rerun", "cancel", "prune", "signal send", "plugins list"):
        assert f"## `runlane {command}`" in text


def test_command_lists_show_each_summary_whole_on_an_80_column_terminal() -> None:
    # Click cuts a summary that does not fit its line with '...' (at any terminal width above 80, too).
    app = build_app()
    groups = [path for path in [(), *command_paths(typer.main.get_command(app), ())] if "Commands:" in _help(app, path)]
    assert len(groups) >= 7
    for path in groups:
        listing = _help(app, path).split("Commands:\n", 1)[1].split("\n\n", 1)[0]
        cut = [line.strip() for line in listing.splitlines() if line.endswith("...")]
        assert not cut, f"runlane {' '.join(path)} --help cuts: {cut}"


def _help(app: typer.Typer, path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=80, env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output
