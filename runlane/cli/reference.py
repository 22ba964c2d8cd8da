"""Generate docs/cli.md from the CLI's own --help texts, so the reference can never drift.

    python -m runlane.cli.reference > docs/cli.md

A test renders the same text and compares it with the committed file.
"""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from .main import build_app

HEADER = """# The `runlane` command

This page is generated from the commands' own `--help` output
(`python -m runlane.cli.reference > docs/cli.md`); a test keeps it current.
"""


def command_paths(group: object, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The path of every visible command and sub-app under ``group``, depth first in name order."""
    paths: list[tuple[str, ...]] = []
    commands = getattr(group, "commands", {})
    for name in sorted(commands):
        command = commands[name]
        if getattr(command, "hidden", False):
            continue
        path = (*prefix, name)
        paths.append(path)
        paths.extend(command_paths(command, path))  # sub-apps are groups with their own commands
    return paths


def render() -> str:
    app = build_app()
    root = typer.main.get_command(app)
    runner = CliRunner()
    sections = [HEADER]
    for path in [(), *command_paths(root, ())]:
        result = runner.invoke(app, [*path, "--help"], terminal_width=100, env={"COLUMNS": "100", "NO_COLOR": "1"})
        title = " ".join(("runlane", *path))
        sections.append(f"## `{title}`\n\n```text\n{result.output.rstrip()}\n```\n")
    return "\n".join(sections)


if __name__ == "__main__":
    print(render(), end="")
