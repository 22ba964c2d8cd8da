"""The examples of ``docs/tasks.md`` and ``docs/sqs.md`` run and print what the guides show under them.

A ``python`` block followed by "prints:" and a ``text`` block is run as a program in an empty
directory and its standard output must equal the text. A block that defines ``test_`` functions is
run with pytest and must pass. Every other ``python`` block must at least compile.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
GUIDE = DOCS / "tasks.md"

_BLOCK = re.compile(r"```(\w+)\n(.*?)\n```", re.DOTALL)


@dataclass(frozen=True)
class Example:
    line: int
    code: str
    prints: str | None


def _examples(text: str) -> list[Example]:
    examples = []
    blocks = list(_BLOCK.finditer(text))
    for index, block in enumerate(blocks):
        if block.group(1) != "python":
            continue
        prints = None
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if following is not None and following.group(1) == "text":
            between = text[block.end() : following.start()]
            if between.strip() == "prints:":
                prints = following.group(2)
        examples.append(Example(text.count("\n", 0, block.start()) + 1, block.group(2), prints))
    return examples


EXAMPLES = _examples(GUIDE.read_text(encoding="utf-8"))
SQS_EXAMPLES = _examples((DOCS / "sqs.md").read_text(encoding="utf-8"))


def test_the_guides_have_examples_that_show_their_output() -> None:
    assert sum(example.prints is not None for example in EXAMPLES) >= 8
    assert any(example.prints is not None for example in SQS_EXAMPLES)
    assert any("def test_" in example.code for example in EXAMPLES)


@pytest.mark.parametrize(
    ("guide", "example"),
    [("tasks.md", example) for example in EXAMPLES] + [("sqs.md", example) for example in SQS_EXAMPLES],
    ids=[f"tasks.md:{e.line}" for e in EXAMPLES] + [f"sqs.md:{e.line}" for e in SQS_EXAMPLES],
)
def test_example(guide: str, example: Example, tmp_path: Path) -> None:
    if example.prints is not None:
        program = tmp_path / "example.py"
        program.write_text(example.code + "\n", encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(program)], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.rstrip("\n") == example.prints, f"docs/{guide} line {example.line}"
    elif "def test_" in example.code:
        module = tmp_path / "test_example.py"
        module.write_text(example.code + "\n", encoding="utf-8")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(module)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout
    else:
        compile(example.code, f"docs/{guide}:{example.line}", "exec")
