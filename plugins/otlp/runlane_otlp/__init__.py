"""runlane-otlp: Runlane's durable observation stream as OpenTelemetry traces, over OTLP/HTTP.

* ``otlp_sink(endpoint=..., headers=..., service_name=...)``: an ``ObservationSink`` for
  ``runlane.observation_exporter(...)``; ``[[exporters]] use = "otlp"`` in ``runlane.toml``;
* ``AttemptSpans``: how observation records become spans, usable with any span exporter.

Each task attempt becomes one span, from ``run.started`` to the event that ended the attempt
(succeeded, failed, retry scheduled, released, cancelled), in the trace of the code that triggered the
run when the trigger carried a W3C ``traceparent``. Durable steps completed during the attempt are
span events. Export is at least once: span ids are derived from the records, so a batch exported
again produces the same spans.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .sink import OtlpObservationSink, otlp_sink
    from .spans import AttemptSpans

__all__ = ["AttemptSpans", "OtlpObservationSink", "otlp_sink"]

# Imported on first use, so loading the plugin (every `runlane` command does) does not import OpenTelemetry.
_EXPORTS = {"AttemptSpans": "spans", "OtlpObservationSink": "sink", "otlp_sink": "sink"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runlane_otlp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
