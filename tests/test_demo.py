"""The README's first command runs this demo; it must keep working as the code under it changes."""

from __future__ import annotations

import subprocess
import sys


def test_demo_prints_the_quick_start_result_then_the_worker_tour() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "runlane_local.demo"], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[:3] == ["queued", "succeeded", '["user_123"]']
    out = completed.stdout
    assert "after the first drain: invoice retrying, report released" in out
    assert "log runlane.task warning: Run run_" in out and "(task invoices.sync): attempt 1 failed" in out
    assert "Traceback" not in completed.stderr
    assert "signal resumed 1 run; tick requested 1 delivery" in out
    assert "invoices.sync: succeeded, attempts=2 failures=1 releases=0" in out
    assert "reports.publish: succeeded, attempts=2 failures=0 releases=1" in out
    assert out.index("run.retry_scheduled") < out.index("run.released")
    assert "$ runlane init config --tasks demo_tasks" in out
    assert "wrote runlane.toml" in out
    assert "tick materialized=1" in out
    assert "$ runlane trigger hello.greet" in out and "✓ created run_" in out
    assert out.count("run succeeded run_") == 2 and "worker stopped runs=2" in out  # triggered + scheduled
    listed = out[out.index("$ runlane runs list"):].splitlines()[2:4]
    assert len(listed) == 2 and all("succeeded  hello.greet" in line for line in listed)
