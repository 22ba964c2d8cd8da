"""Observation sinks over OpenTelemetry's own exporters.

* ``otlp_sink()``: every observation record as a log record, to an OTLP/HTTP logs endpoint (a
  Collector's ``/v1/logs``);
* ``opentelemetry_sink(exporter=...)``: the same log records through any OpenTelemetry log record
  exporter you configured yourself (another transport, gRPC, a preconfigured client);
* ``otlp_trace_sink()``: every finished attempt as a span, to an OTLP/HTTP traces endpoint.

The exporter runs in a worker thread, so the event loop never waits on the network; OpenTelemetry's
OTLP/HTTP exporters retry throttling and 5xx answers themselves within ``timeout``. A batch the
endpoint did not accept raises a retryable ``observation_export_failed``: the exporter loop keeps its
checkpoint and sends the batch again later. Log records carry the record's stable id
(``runlane.observation_id``) and span ids are derived from the records, so a batch sent twice can be
told apart from new telemetry.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from runlane.errors import ErrorCode, RunlaneError
from runlane.models import RunlaneObservationRecord

from ._otel import observation_resource
from .checks import DEFAULT_LOGS_ENDPOINT, DEFAULT_TRACES_ENDPOINT, check_endpoint, check_resource, timeout_seconds
from .logs import ObservationLogs
from .spans import AttemptSpans

__all__ = [
    "DEFAULT_LOGS_ENDPOINT",
    "DEFAULT_TRACES_ENDPOINT",
    "OtlpObservationSink",
    "opentelemetry_sink",
    "otlp_sink",
    "otlp_trace_sink",
]



class _Mapping(Protocol):
    def feed(self, records: Sequence[RunlaneObservationRecord]) -> list[Any]: ...


class OtlpObservationSink:
    """Build it with ``otlp_sink()``, ``opentelemetry_sink()`` or ``otlp_trace_sink()``: ``mapping``
    turns records into telemetry items (``what`` they are), ``exporter`` sends them."""

    def __init__(self, *, mapping: _Mapping, exporter: Any, endpoint: str, what: str) -> None:
        self.mapping = mapping
        self.exporter = exporter
        self.endpoint = endpoint
        self.what = what
        self.exported = 0

    def __repr__(self) -> str:
        return f"OtlpObservationSink({self.what}, endpoint={self.endpoint!r}, exported={self.exported})"

    async def export(self, records: Sequence[RunlaneObservationRecord]) -> None:
        items = self.mapping.feed(records)
        if not items:
            return
        result = await asyncio.to_thread(self.exporter.export, items)
        if getattr(result, "name", None) != "SUCCESS":  # SpanExportResult / LogRecordExportResult
            raise RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"{self.endpoint} did not accept {len(items)} {self.what} (it refused them or did not answer "
                "in time); the batch is sent again.",
                retryable=True,
                meta={"endpoint": self.endpoint, self.what.replace(" ", "_"): len(items)},
            )
        self.exported += len(items)

    def close(self) -> None:
        """Shut the exporter down (its HTTP session, for the OTLP/HTTP ones)."""
        self.exporter.shutdown()


def _check(endpoint: object, default: str, timeout: object, service_name: object, attributes: object) -> float:
    """Checks the options of an OTLP/HTTP sink; returns the timeout in seconds."""
    check_endpoint(endpoint, default)
    seconds = timeout_seconds(timeout)
    check_resource(service_name, attributes)
    return seconds


def otlp_sink(
    *,
    endpoint: str = DEFAULT_LOGS_ENDPOINT,
    headers: Mapping[str, str] | None = None,
    timeout: float | str | timedelta = 10.0,
    service_name: str = "runlane",
    resource_attributes: Mapping[str, str] | None = None,
) -> OtlpObservationSink:
    """A sink sending every observation record as a log record to ``endpoint`` (OTLP/HTTP, protobuf).

    ``endpoint`` is the full logs URL (``http://collector:4318/v1/logs``); ``headers`` go with every
    request (an API key, say); ``timeout`` (a duration such as ``"10s"``, or seconds) bounds one export,
    retries included; ``service_name`` and
    ``resource_attributes`` describe the resource the records come from.
    """
    seconds = _check(endpoint, DEFAULT_LOGS_ENDPOINT, timeout, service_name, resource_attributes)
    exporter = OTLPLogExporter(endpoint=endpoint, headers=dict(headers or {}), timeout=seconds)
    return _log_sink(exporter, endpoint, service_name, resource_attributes)


def opentelemetry_sink(
    *,
    exporter: Any,
    service_name: str = "runlane",
    resource_attributes: Mapping[str, str] | None = None,
) -> OtlpObservationSink:
    """A sink sending every observation record as a log record through ``exporter``, an OpenTelemetry
    log record exporter (``export(batch)`` and ``shutdown()``) configured however you need."""
    if not callable(getattr(exporter, "export", None)) or not callable(getattr(exporter, "shutdown", None)):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            "exporter must be an OpenTelemetry log record exporter with export() and shutdown(), "
            f"such as OTLPLogExporter(...), got {type(exporter).__name__}.",
            meta={"field": "exporter"},
        )
    check_resource(service_name, resource_attributes)
    endpoint = str(getattr(exporter, "_endpoint", None) or type(exporter).__name__)
    return _log_sink(exporter, endpoint, service_name, resource_attributes)


def _log_sink(
    exporter: Any, endpoint: str, service_name: str, attributes: Mapping[str, str] | None
) -> OtlpObservationSink:
    mapping = ObservationLogs(resource=observation_resource(service_name, attributes))
    return OtlpObservationSink(mapping=mapping, exporter=exporter, endpoint=endpoint, what="log records")


def otlp_trace_sink(
    *,
    endpoint: str = DEFAULT_TRACES_ENDPOINT,
    headers: Mapping[str, str] | None = None,
    timeout: float | str | timedelta = 10.0,
    service_name: str = "runlane",
    resource_attributes: Mapping[str, str] | None = None,
) -> OtlpObservationSink:
    """A sink sending each finished attempt as a span to ``endpoint`` (OTLP/HTTP, protobuf), under the
    trace that triggered its run. Options as for ``otlp_sink()``, with the traces URL
    (``http://collector:4318/v1/traces``)."""
    seconds = _check(endpoint, DEFAULT_TRACES_ENDPOINT, timeout, service_name, resource_attributes)
    exporter = OTLPSpanExporter(endpoint=endpoint, headers=dict(headers or {}), timeout=seconds)
    mapping = AttemptSpans(resource=observation_resource(service_name, resource_attributes))
    return OtlpObservationSink(mapping=mapping, exporter=exporter, endpoint=endpoint, what="spans")
