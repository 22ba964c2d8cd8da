"""``otlp_sink()``: an observation sink that sends attempt spans to an OTLP/HTTP endpoint.

It uses OpenTelemetry's own OTLP/HTTP span exporter (protobuf, with its retries for throttling and
5xx answers), run in a worker thread so the event loop never waits on the network. A batch the
endpoint did not accept raises a retryable ``observation_export_failed``: the exporter loop keeps its
checkpoint and sends the batch again later, and the derived span ids keep that from duplicating spans.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from runlane.errors import ErrorCode, RunlaneError
from runlane.models import RunlaneObservationRecord

from .spans import AttemptSpans

__all__ = ["OtlpObservationSink", "otlp_sink"]

DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"


class OtlpObservationSink:
    """Build it with ``otlp_sink()``. ``spans`` turns records into spans; ``exporter`` sends them."""

    def __init__(self, *, spans: AttemptSpans, exporter: Any, endpoint: str) -> None:
        self.spans = spans
        self.exporter = exporter
        self.endpoint = endpoint
        self.exported = 0

    def __repr__(self) -> str:
        return f"OtlpObservationSink(endpoint={self.endpoint!r}, exported={self.exported})"

    async def export(self, records: Sequence[RunlaneObservationRecord]) -> None:
        spans = self.spans.feed(records)
        if not spans:
            return
        result = await asyncio.to_thread(self.exporter.export, spans)
        if result is not SpanExportResult.SUCCESS:
            raise RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"The OTLP endpoint {self.endpoint} did not accept {len(spans)} spans; the batch is sent again.",
                retryable=True,
                meta={"endpoint": self.endpoint, "spans": len(spans)},
            )
        self.exported += len(spans)

    def close(self) -> None:
        """Release the exporter's HTTP session."""
        self.exporter.shutdown()


def otlp_sink(
    *,
    endpoint: str = DEFAULT_ENDPOINT,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
    service_name: str = "runlane",
) -> OtlpObservationSink:
    """A sink sending each finished attempt as a span to ``endpoint`` (OTLP/HTTP, protobuf).

    ``endpoint`` is the full traces URL (``http://collector:4318/v1/traces``); ``headers`` go with every
    request (an API key, say); ``timeout`` bounds one export, retries included; ``service_name`` is the
    ``service.name`` resource attribute the spans carry.
    """
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"endpoint must be an http(s) URL such as {DEFAULT_ENDPOINT}, got {endpoint!r}.",
            meta={"field": "endpoint"},
        )
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID, f"timeout must be a positive number of seconds, got {timeout!r}."
        )
    if not isinstance(service_name, str) or not service_name:
        raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "service_name must be a non-empty string.")
    exporter = OTLPSpanExporter(endpoint=endpoint, headers=dict(headers or {}), timeout=timeout)
    return OtlpObservationSink(spans=AttemptSpans(service_name=service_name), exporter=exporter, endpoint=endpoint)
