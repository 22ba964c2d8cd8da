"""Shared scaffolding for tests that run the installed ``runlane`` script in a temporary project."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

RUNLANE = shutil.which("runlane", path=str(Path(sys.executable).parent)) or shutil.which("runlane")

TASKS_MODULE = """
from datetime import UTC, datetime

from pydantic import BaseModel

from runlane import queue, schedule, task

emails = queue("emails", default=True)


class Welcome(BaseModel):
    user_id: str


@task(
    "emails.welcome",
    queue=emails,
    schedule=schedule("welcome.once", run_at=datetime(2020, 1, 1, tzinfo=UTC), payload={"user_id": "user_1"}),
)
def send_welcome(payload: Welcome) -> dict:
    return {"sent": payload.user_id}
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RUNLANE_LOAD_PLUGINS", None)
    env["COLUMNS"] = "200"
    return env


def cli(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    assert RUNLANE is not None, "the runlane console script is not installed; run pip install -e ."
    return subprocess.run([RUNLANE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=cli_env())


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def make_project(root: Path) -> Path:
    """A project with a scheduled task (``app.tasks``), configured through ``runlane init config``."""
    write(root / "app" / "__init__.py", "")
    write(root / "app" / "tasks.py", TASKS_MODULE)
    result = cli(root, "init", "config", "--tasks", "app.tasks")
    assert result.returncode == 0, result.stderr
    return root
