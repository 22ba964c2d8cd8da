"""docs/cli.md is generated from the commands' own --help texts; it must match them."""

from __future__ import annotations

from pathlib import Path

from runlane.cli.reference import render

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
