"""Runlane test helpers and conformance suites.

``StorageDriverConformance`` is imported lazily because it needs pytest, while ``ControlledClock``
works in any test runner. Importing it through this package registers the suite module for pytest's
assertion rewriting, so a failing conformance check reports the compared values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .clock import ControlledClock

if TYPE_CHECKING:
    from .storage_conformance import StorageDriverConformance

__all__ = ["ControlledClock", "StorageDriverConformance"]


def __getattr__(name: str) -> Any:
    if name == "StorageDriverConformance":
        import pytest

        pytest.register_assert_rewrite(f"{__name__}.storage_conformance")
        from .storage_conformance import StorageDriverConformance

        return StorageDriverConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
