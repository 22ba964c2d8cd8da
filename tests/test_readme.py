"""Every Python example of the README runs as written and prints what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def _expected(block: str) -> list[str]:
    """The outputs the comments after each ``print(...)`` promise, in order."""
    lines = block.splitlines()
    return [line.split("#", 1)[1].strip() for line in lines if line.strip().startswith("print(") and "#" in line]


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS, ids=[f"example-{index}" for index in range(len(BLOCKS))])
def test_a_readme_example_runs_as_written(block: str, tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    expected = _expected(block)
    assert expected, "each example prints what it shows"
    assert completed.stdout.splitlines() == expected
