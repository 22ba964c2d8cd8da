"""runlane-otlp: Runlane's durable observation stream as OpenTelemetry logs and traces, over OTLP/HTTP.

* ``otlp_sink(endpoint=..., headers=..., resource_attributes=...)``: every observation record as an
  OpenTelemetry log record, sent to a Collector's ``/v1/logs``; ``[[exporters]] use = "otlp"``;
* ``opentelemetry_sink(exporter=...)``: the same log records through an OpenTelemetry log record
  exporter you configured yourself;
* ``otlp_trace_sink(...)``: each finished attempt as a span, under the trace that triggered its run;
  ``[[exporters]] use = "otlp-traces"``;
* ``ObservationLogs`` and ``AttemptSpans``: the two mappings, usable with any exporter.

Export is at least once: log records carry the observation record's stable id and span ids are
derived from the records, so a batch exported again can be recognised.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .logs import ObservationLogs as ObservationLogs
    from .sink import (
        OtlpObservationSink as OtlpObservationSink,
        opentelemetry_sink as opentelemetry_sink,
        otlp_sink as otlp_sink,
        otlp_trace_sink as otlp_trace_sink,
    )
    from .spans import AttemptSpans as AttemptSpans

__all__ = [
    "AttemptSpans",
    "ObservationLogs",
    "OtlpObservationSink",
    "opentelemetry_sink",
    "otlp_sink",
    "otlp_trace_sink",
]

# Imported on first use, so loading the plugin (every `runlane` command does) does not import OpenTelemetry.
_EXPORTS = {
    "AttemptSpans": "spans",
    "ObservationLogs": "logs",
    "OtlpObservationSink": "sink",
    "opentelemetry_sink": "sink",
    "otlp_sink": "sink",
    "otlp_trace_sink": "sink",
}

# Hidden from type checkers, which would otherwise take any misspelt import from this package as ``Any``;
# they see the names imported above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'runlane_otlp' has no attribute {name!r}")
        return getattr(importlib.import_module(f".{module}", __name__), name)
