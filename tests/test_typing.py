"""Runlane's type information as users' type checkers see it, and the packages' own type check.

The packages (the ``[tool.mypy]`` files of ``pyproject.toml``) must pass mypy. The programs in
``tests/typing/`` are checked with ``mypy --strict`` in a subprocess: the annotated application and
plugin must pass cleanly, and every mistake in ``misuse.py`` must be reported on its line with its error
code (so the test fails if the types go missing or turn into ``Any``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "typing"

_EXPECT = re.compile(r"#\s*expect:\s*\[([a-z-]+)\]$")
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    # Run outside the checkout, so that the packages are found installed, as a user's checker finds them
    # (inside it mypy would read the source folders directly and never look for the py.typed markers).
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *arguments],
        cwd=cache,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _errors(output: str) -> set[tuple[str, int, str]]:
    errors = set()
    for line in output.splitlines():
        match = _ERROR.match(line)
        if match is not None:
            errors.add((Path(match["path"]).name, int(match["line"]), match["code"]))
    return errors


@pytest.mark.parametrize("program", ["user_app.py", "third_party_plugin.py"])
def test_a_program_written_as_the_guides_show_passes_strict_checking(program: str, mypy_cache: Path) -> None:
    result = _mypy(mypy_cache, "--strict", str(PROGRAMS / program))
    assert result.returncode == 0, result.stdout + result.stderr


def test_mistakes_against_the_public_api_are_reported_where_they_are(mypy_cache: Path) -> None:
    source = PROGRAMS / "misuse.py"
    expected = {
        (source.name, number, match[1])
        for number, text in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1)
        if (match := _EXPECT.search(text)) is not None
    }
    assert len(expected) >= 10
    result = _mypy(mypy_cache, "--strict", str(source))
    assert _errors(result.stdout) == expected, result.stdout + result.stderr


def test_the_packages_pass_their_own_type_check(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
