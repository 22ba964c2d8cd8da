"""``OtlpTestReceiver``: an OTLP/HTTP logs and traces endpoint on a loopback port, for tests.

It accepts ``POST /v1/logs`` and ``POST /v1/traces`` with the protobuf ``ExportLogsServiceRequest`` /
``ExportTraceServiceRequest`` OpenTelemetry's OTLP/HTTP exporters send (gzip- or deflate-compressed too),
decodes them with OpenTelemetry's own protobuf classes and keeps the log records and spans; a body that
does not decode is answered with HTTP 400, as a Collector answers it. ``fail_next(count, status=503)``
answers the next requests with an error status, as an overloaded collector would::

    with OtlpTestReceiver() as receiver:
        sink = otlp_sink(endpoint=receiver.logs_endpoint)
        ...
        receiver.logs  # [ReceivedLogRecord(body="run.created", attributes={...}), ...]
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpTestReceiver", "ReceivedLogRecord", "ReceivedSpan"]

MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as the endpoint received it (ids as lowercase hex, times in Unix nanoseconds)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_time: int
    end_time: int
    status_code: int
    status_message: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReceivedLogRecord:
    """One log record as the endpoint received it (ids as lowercase hex, "" when absent; times in Unix
    nanoseconds)."""

    body: Any
    event_name: str
    severity_number: int
    severity_text: str
    time: int
    observed_time: int
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _decompressed(body: bytes, encoding: str | None) -> bytes:
    """``body`` as sent before the ``Content-Encoding`` the exporter applied (``OTEL_EXPORTER_OTLP_COMPRESSION``)."""
    match (encoding or "").strip().lower():
        case "gzip":
            return gzip.decompress(body)
        case "deflate":
            return zlib.decompress(body)
        case _:
            return body


class OtlpTestReceiver:
    """An OTLP/HTTP receiver on ``host`` and a free port: ``logs_endpoint`` and ``traces_endpoint`` are
    its URLs; ``logs`` and ``spans`` what it accepted."""

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self.logs: list[ReceivedLogRecord] = []
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._failures: list[tuple[int, dict[str, str]]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server naming
                receiver._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._thread: threading.Thread | None = None

    @property
    def logs_endpoint(self) -> str:
        host, port = self._bound_address()
        return f"http://{host}:{port}/v1/logs"

    @property
    def traces_endpoint(self) -> str:
        host, port = self._bound_address()
        return f"http://{host}:{port}/v1/traces"

    def _bound_address(self) -> tuple[str, int]:
        # The server is bound to an AF_INET(6) socket, whose getsockname() host is always a str.
        return cast("tuple[str, int]", self._server.server_address[:2])

    def __enter__(self) -> OtlpTestReceiver:
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-test-receiver", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def fail_next(
        self, count: int = 1, status: int = 503, *, retry_after: str | None = None, location: str | None = None
    ) -> None:
        """Answer the next ``count`` requests with ``status`` (and a ``Retry-After`` or, for a redirect, a
        ``Location`` header when given) and keep nothing from them."""
        headers = {"Retry-After": retry_after, "Location": location}
        with self._lock:
            self._failures.extend([(status, {k: v for k, v in headers.items() if v is not None})] * count)

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        decode = {"/v1/logs": self._logs, "/v1/traces": self._spans}.get(request.path)
        if decode is None or not 0 < length <= MAX_BODY_BYTES:
            request.send_error(404 if decode is None else 400)
            return
        body = request.rfile.read(length)
        with self._lock:
            self.requests += 1
            failure = self._failures.pop(0) if self._failures else None
        if failure is not None:
            status, headers = failure
            request.send_response(status)
            for name, value in headers.items():
                request.send_header(name, value)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        try:
            answer = decode(_decompressed(body, request.headers.get("Content-Encoding")))
        except Exception:  # noqa: BLE001 - gzip's, zlib's or protobuf's refusal of the body: the sender's error
            request.send_error(400, "the body is not a protobuf OTLP export request")  # as a Collector answers
            return
        request.send_response(200)
        request.send_header("Content-Type", "application/x-protobuf")
        request.send_header("Content-Length", str(len(answer)))
        request.end_headers()
        request.wfile.write(answer)

    def _logs(self, body: bytes) -> bytes:
        message = ExportLogsServiceRequest()
        message.ParseFromString(body)
        received = [
            ReceivedLogRecord(
                body=_value(record.body),
                event_name=record.event_name,
                severity_number=record.severity_number,
                severity_text=record.severity_text,
                time=record.time_unix_nano,
                observed_time=record.observed_time_unix_nano,
                trace_id=record.trace_id.hex(),
                span_id=record.span_id.hex(),
                attributes=_attributes(record.attributes),
                resource=_attributes(resource_logs.resource.attributes),
                scope=scope_logs.scope.name,
            )
            for resource_logs in message.resource_logs
            for scope_logs in resource_logs.scope_logs
            for record in scope_logs.log_records
        ]
        with self._lock:
            self.logs.extend(received)
        return ExportLogsServiceResponse().SerializeToString()

    def _spans(self, body: bytes) -> bytes:
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        received = []
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_time=span.start_time_unix_nano,
                            end_time=span.end_time_unix_nano,
                            status_code=span.status.code,
                            status_message=span.status.message,
                            attributes=_attributes(span.attributes),
                            events=[
                                (event.name, event.time_unix_nano, _attributes(event.attributes))
                                for event in span.events
                            ],
                            resource=resource,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return ExportTraceServiceResponse().SerializeToString()
