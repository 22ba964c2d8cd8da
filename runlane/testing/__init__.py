"""Runlane test helpers and conformance suites.

The conformance suites (``StorageDriverConformance``, ``TransportConformance``,
``LaneCompositionConformance``) are imported lazily because they need pytest, while ``ControlledClock``,
``run_until_idle`` and the waiting helpers (``wait_for_run_status`` and its kin) work in any test runner.
Importing a suite through this package registers its module for pytest's assertion rewriting, so a
failing conformance check reports the compared values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .clock import ControlledClock
from .driving import run_until_idle
from .transport import RecordingTransport
from .waiting import list_run_event_types, wait_for_condition, wait_for_run_event, wait_for_run_status

if TYPE_CHECKING:
    from .lane_conformance import LaneCompositionConformance as LaneCompositionConformance
    from .storage_conformance import StorageDriverConformance as StorageDriverConformance
    from .transport_conformance import TransportConformance as TransportConformance

__all__ = [
    "ControlledClock",
    "LaneCompositionConformance",
    "RecordingTransport",
    "StorageDriverConformance",
    "TransportConformance",
    "list_run_event_types",
    "run_until_idle",
    "wait_for_condition",
    "wait_for_run_event",
    "wait_for_run_status",
]

_SUITES = {
    "LaneCompositionConformance": "lane_conformance",
    "StorageDriverConformance": "storage_conformance",
    "TransportConformance": "transport_conformance",
}

# Hidden from type checkers, which would otherwise take any misspelt import from this package as ``Any``;
# they see the suites imported above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _SUITES.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        import pytest

        pytest.register_assert_rewrite(f"{__name__}.{module}")
        return getattr(importlib.import_module(f".{module}", __name__), name)
