"""The lane scenarios over the SQLite lane: each ``new()`` is a fresh database file, and ``peer()`` is
another lane over the same file (another process's view)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lane_scenarios import LaneFactory, LaneScenarios
from runlane_local import sqlite_lane


class TestSqliteLaneScenarios(LaneScenarios):
    @pytest.fixture
    def lanes(self, tmp_path: Path) -> LaneFactory:
        files: list[Path] = []

        def new():
            files.append(tmp_path / f"lane-{len(files)}.db")
            return sqlite_lane(files[-1])

        return LaneFactory(new=new, peer=lambda: sqlite_lane(files[-1]))
