"""Every ``runlane ...`` command line of README.md and docs/*.md names a real command and real options.

The lines come from the guides' shell, YAML and INI blocks and from inline code in their prose
(docs/cli.md is generated from the commands themselves). A renamed command or option, or one the
guides invent, fails here instead of failing a user who copies the line.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from runlane.cli.main import build_app

ROOT = Path(__file__).resolve().parent.parent
GUIDES = [ROOT / "README.md", *sorted(path for path in (ROOT / "docs").glob("*.md") if path.name != "cli.md")]

_BLOCK = re.compile(r"```(\w*)\n(.*?)\n```", re.DOTALL)
_CODE_BLOCK_LINE = re.compile(r"(?:^|[\s=/(])(runlane(?:\s+[^#|;&`\])]+))")
_INLINE = re.compile(r"`(runlane [^`]+)`")


def _command_lines(text: str) -> list[str]:
    lines = []
    for block in _BLOCK.finditer(text):
        if block.group(1) in ("python", "toml", "json", "text", "sql"):
            continue
        for line in block.group(2).splitlines():
            line = line.replace('", "', " ").replace('["', " ").replace('"]', " ")  # a container's args list
            lines.extend(match.group(1).strip() for match in _CODE_BLOCK_LINE.finditer(line))
    prose = _BLOCK.sub("", text)
    lines.extend(" ".join(match.group(1).split()) for match in _INLINE.finditer(prose))
    return lines


COMMAND_LINES = list(
    dict.fromkeys((guide.name, line) for guide in GUIDES for line in _command_lines(guide.read_text(encoding="utf-8")))
)


@functools.cache
def _root() -> Any:
    return typer.main.get_command(build_app())


def _problem(root: Any, line: str) -> str | None:
    """What is wrong with ``line`` as a ``runlane`` command line, or ``None``."""
    tokens = shlex.split(line, comments=True)[1:]
    command, path, params = root, ["runlane"], list(root.params)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token.startswith("-") and token != "-":
            name = token.split("=", 1)[0]
            param = next((param for param in params if name in (*param.opts, *param.secondary_opts)), None)
            if param is None:
                return f"{' '.join(path)} has no option {name}"
            if not getattr(param, "is_flag", False) and "=" not in token:
                index += 1  # its value (the words after it that are not options are taken as arguments)
        elif hasattr(command, "commands"):
            if token not in command.commands:
                return f"{' '.join(path)} has no command {token!r}"
            command = command.commands[token]
            path.append(token)
            params = [*params, *command.params]
        index += 1
    return None


def test_the_guides_name_runlane_commands() -> None:
    assert len(COMMAND_LINES) >= 60
    assert ("README.md", "runlane work --concurrency 8") in COMMAND_LINES
    assert ("operations.md", "runlane work --concurrency 16 --worker-id %H-%i") in COMMAND_LINES  # systemd
    assert ("tasks.md", """runlane --json trigger reports.render '{"month": "2026-11"}'""") in COMMAND_LINES  # $(...)
    kubernetes = "runlane work --concurrency 16 --lease-duration 60s --health-file /tmp/runlane-alive"
    assert ("operations.md", kubernetes) in COMMAND_LINES  # a container's args list


def test_the_check_finds_a_wrong_command_or_option() -> None:
    root = _root()
    assert _problem(root, "runlane work --concurency 8") == "runlane work has no option --concurency"
    assert _problem(root, "runlane runs show RUN_ID") == "runlane runs has no command 'show'"
    assert _problem(root, "runlane --json runs list --status failed queued --limit 5") is None


@pytest.mark.parametrize(("guide", "line"), COMMAND_LINES, ids=[f"{guide}: {line}" for guide, line in COMMAND_LINES])
def test_a_command_line_of_the_guides_exists(guide: str, line: str) -> None:
    assert _problem(_root(), line) is None
