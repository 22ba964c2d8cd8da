"""Runlane test helpers and conformance suites.

``StorageDriverConformance`` is imported lazily because it needs pytest, while ``ControlledClock``
works in any test runner. Importing it through this package registers the suite module for pytest's
assertion rewriting, so a failing conformance check reports the compared values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .clock import ControlledClock
from .transport import RecordingTransport

if TYPE_CHECKING:
    from .storage_conformance import StorageDriverConformance
    from .transport_conformance import TransportConformance

__all__ = ["ControlledClock", "RecordingTransport", "StorageDriverConformance", "TransportConformance"]


def __getattr__(name: str) -> Any:
    if name == "StorageDriverConformance":
        import pytest

        pytest.register_assert_rewrite(f"{__name__}.storage_conformance")
        from .storage_conformance import StorageDriverConformance

        return StorageDriverConformance
    if name == "TransportConformance":
        import pytest

        pytest.register_assert_rewrite(f"{__name__}.transport_conformance")
        from .transport_conformance import TransportConformance

        return TransportConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
