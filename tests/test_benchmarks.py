"""Every benchmark script still runs end to end (tiny sizes) and prints its figures.

The figures themselves are not asserted (speed targets live in the scripts' output, not in tests);
this keeps the scripts from rotting as the runtime changes. The Postgres benchmark starts its own
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
    "sqlite_bench.py": (
        ["--runs", "40", "--producers", "2", "--concurrency", "2", "--latency-samples", "5"],
        ("trigger-to-start",),
    ),
    "postgres_bench.py": (
        ["--runs", "60", "--processes", "1", "--concurrency", "4", "--producers", "2", "--triggers", "30"]
        + ["--latency-samples", "5", "--statements"],
        ("trigger-to-start", "server execution time per run, by statement", "runlane_commit("),
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
