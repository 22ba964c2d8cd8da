"""Every benchmark script still runs end to end (tiny sizes) and prints its figures.

The figures themselves are not asserted (speed targets live in the scripts' output, not in tests);
this keeps the scripts from rotting as the runtime changes. How the Postgres latency breakdown pairs
wake hints with samples is checked on its own, with made-up times. The Postgres benchmark starts its own
throwaway server (unless ``RUNLANE_POSTGRES_BENCH_URL`` names a database), like the Postgres tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

CASES = {
    "storage_bench.py": (["--transactions", "200"], ("transactions",)),
    "reducer_bench.py": (["--runs", "200", "--repeat", "1"], ("events",)),
    "runtime_bench.py": (["--runs", "100", "--latency-samples", "5"], ("end to end",)),
    "tick_bench.py": (["--runs", "100"], ("runs",)),
    "bounded_bench.py": (["--runs", "60", "--others", "10"], ("backlog:", "other keys:")),
    "listing_bench.py": (["--runs", "200", "--rounds", "2"], ("newest page after a write",)),
    "memory_bench.py": (["--batches", "3", "--runs", "50"], ("RSS after each batch", "growth after the first batch")),
    "sqlite_bench.py": (
        ["--runs", "40", "--producers", "2", "--concurrency", "2", "--latency-samples", "5"],
        ("trigger-to-start", "watcher hearing of a trigger"),
    ),
    "postgres_bench.py": (
        ["--runs", "60", "--processes", "1", "--concurrency", "2,4", "--producers", "2", "--triggers", "30"]
        + ["--latency-samples", "5", "--statements"],
        ("trigger-to-start", "server execution time per run, by statement", "runlane_commit(")
        + ("1 worker processes x 2 slots", "1 worker processes x 4 slots"),
    ),
}


def test_every_benchmark_script_is_covered() -> None:
    assert sorted(path.name for path in BENCHMARKS.glob("*.py")) == sorted(CASES)


def _run(script: str, arguments: list[str]) -> str:
    """The script's output; it must exit 0."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Nothing on stderr: a log record per run (a deliberate failure, say) would bury the figures.
    assert result.stderr == "", result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_and_prints_its_figures(script: str) -> None:
    arguments, expected = CASES[script]
    output = _run(script, arguments)
    for text in expected:
        assert text in output, output


@pytest.mark.parametrize(
    ("script", "arguments"),
    [
        ("runtime_bench.py", ["--runs", "50", "--latency-samples", "0"]),
        ("sqlite_bench.py", ["--runs", "20", "--producers", "2", "--concurrency", "2", "--latency-samples", "0"]),
    ],
)
def test_no_latency_samples_skips_the_latency_measurement(script: str, arguments: list[str]) -> None:
    output = _run(script, arguments)
    assert "runs/s" in output and "trigger-to-start" not in output, output


def test_the_latency_breakdown_pairs_each_sample_with_the_hint_its_trigger_sent() -> None:
    """Back-to-back samples are a few milliseconds apart: the previous sample's hint, or a hint that
    arrives just before ``trigger()`` returns, must not be mistaken for another sample's."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from postgres_bench import latency_parts
    finally:
        sys.path.remove(str(BENCHMARKS))
    returned = [(10.000, 10.0015), (10.004, 10.0055), (10.020, 10.0215)]  # (trigger() called, returned)
    handlers = [10.0035, 10.0075, 10.0240]
    hints = [10.0014, 10.0056, 10.0230]  # the first before its trigger() returned
    commits, delivery, claims = latency_parts(returned, handlers, hints)
    assert [round(value, 3) for value in commits] == [1.5, 1.5, 1.5]
    assert [round(value, 3) for value in delivery] == [-0.1, 0.1, 1.5]
    assert [round(value, 3) for value in claims] == [2.1, 1.9, 1.0]

    # A sample whose hint was lost (the worker polled) has only its commit part.
    commits, delivery, claims = latency_parts(returned, handlers, [10.0014, 10.0230])
    assert len(commits) == 3 and [round(value, 3) for value in claims] == [2.1, 1.0]
