"""The README's first command runs this demo; it must keep working as the code under it changes."""

from __future__ import annotations

import subprocess
import sys


def test_demo_walks_one_run_to_success_and_shows_the_lost_race() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "runlane_local.demo"], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert "status=succeeded" in out
    assert "storage_conflict (event_sequence), retryable=True" in out
    assert out.index("run.created") < out.index("run.lease_claimed") < out.index("run.succeeded")
    assert "{'email_id': 'em_42'}" in out
