"""Observation sinks over OpenTelemetry's own exporters.

* ``otlp_sink()``: every observation record as a log record, to an OTLP/HTTP logs endpoint (a
  Collector's ``/v1/logs``);
* ``opentelemetry_sink(exporter=...)``: the same log records through any OpenTelemetry log record
  exporter you configured yourself (another transport, gRPC, a preconfigured client);
* ``otlp_trace_sink()``: every finished attempt as a span, to an OTLP/HTTP traces endpoint.

The exporter runs in a worker thread, so the event loop never waits on the network; OpenTelemetry's
OTLP/HTTP exporters retry throttling and 5xx answers themselves within ``timeout``. A batch the
endpoint did not accept raises ``observation_export_failed``: the exporter loop keeps its checkpoint
and sends the batch again later. It is not retryable when the endpoint refused the request for good
(a 4xx other than 408 and 429, or 501: a wrong path, a missing API key, a batch too large), when it
redirected the request (a 3xx, which OpenTelemetry counts as accepted but does not follow), or when
the request could not even be built (a header value HTTP cannot carry), so that the loop stops instead
of sending it forever. The mapping's memory of open attempts and trace
contexts is rolled back with a batch that was not accepted. Log records carry the record's stable
id (``runlane.observation_id``) and span ids are derived from the records, so a batch sent twice can
be told apart from new telemetry. While a sink exports, OpenTelemetry's own per-attempt warnings are
left out: the exporter loop reports an outage once, and its end.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from runlane.errors import ErrorCode, RunlaneError
from runlane.models import RunlaneObservationRecord

from ._otel import observation_resource
from .checks import (
    DEFAULT_LOGS_ENDPOINT,
    DEFAULT_TRACES_ENDPOINT,
    check_environment_headers,
    check_headers,
    Signal,
    check_resource,
    header_problem,
    redact_endpoint,
    resolve_endpoint,
    timeout_seconds,
)
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

    def rollback(self) -> None: ...


# Answers an endpoint refuses for good: sending the batch again cannot help.
_PERMANENT = frozenset(range(400, 500)) - {408, 429} | {501}

_exporting = threading.local()  # set on a thread while it runs a sink's export


class _WhileExporting(logging.Filter):
    """Leaves out OpenTelemetry's per-attempt export warnings on a thread a sink exports on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_exporting, "active", False)


_QUIET = _WhileExporting()


class _Answers:
    """The HTTP status of the endpoint's last answer to an OTLP/HTTP exporter, which OpenTelemetry keeps
    to itself (``export()`` says only SUCCESS or FAILURE); ``None`` when not known. ``error`` is the
    exception of a request that got no answer, and ``headers`` those the exporter sends."""

    def __init__(self, exporter: Any) -> None:
        self.status: int | None = None
        self.reason: str | None = None
        self.error: BaseException | None = None
        self.retry_after: float | None = None  # seconds a 429 or 503 asked the client to wait
        self.location: str | None = None  # where a redirect pointed
        client: Any = getattr(exporter, "_client", None)
        headers = getattr(client, "_headers", None)
        self.headers: Mapping[Any, Any] = headers if isinstance(headers, Mapping) else {}
        send = getattr(client, "export", None)
        if not callable(send):
            return
        logger = getattr(client, "_logger", None)
        if isinstance(logger, logging.Logger) and _QUIET not in logger.filters:
            logger.addFilter(_QUIET)

        def recorded(data: Any) -> Any:
            result = send(data)
            status = getattr(result, "status_code", None)
            self.status = status if isinstance(status, int) else None
            reason = getattr(result, "reason", None)
            self.reason = reason if isinstance(reason, str) else None
            error = getattr(result, "error", None)
            self.error = error if isinstance(error, BaseException) else None
            return result

        client.export = recorded
        submit = getattr(client, "_submit", None)  # one HTTP request: its answer's headers are kept there
        if not callable(submit):
            return

        def submitted(*args: Any, **kwargs: Any) -> Any:
            result = submit(*args, **kwargs)
            try:
                value = result.headers().get("retry-after")
                location = result.headers().get("location")
            except Exception:  # noqa: BLE001 - an answer without readable headers asks for nothing
                value = location = None
            self.retry_after = _retry_after(value)
            self.location = location if isinstance(location, str) and location else None
            return result

        client._submit = submitted


def _retry_after(value: object) -> float | None:
    """The seconds a ``Retry-After`` header asks for (a number of seconds, or an HTTP date), or ``None``."""
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        at = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if at.tzinfo is None:
        return None
    return max((at - datetime.now(UTC)).total_seconds(), 0.0)


class OtlpObservationSink:
    """Build it with ``otlp_sink()``, ``opentelemetry_sink()`` or ``otlp_trace_sink()``: ``mapping``
    turns records into telemetry items (``what`` they are), ``exporter`` sends them. ``endpoint`` is
    the URL for messages, its credentials and query values masked (``redact_endpoint``)."""

    def __init__(self, *, mapping: _Mapping, exporter: Any, endpoint: str, what: str) -> None:
        self.mapping = mapping
        self.exporter = exporter
        self.endpoint = redact_endpoint(endpoint)
        self.what = what
        self.exported = 0
        self._answers = _Answers(exporter)
        self._accepted: frozenset[str] = frozenset()  # the record ids of the last batch the endpoint accepted

    def __repr__(self) -> str:
        return f"OtlpObservationSink({self.what}, endpoint={self.endpoint!r}, exported={self.exported})"

    async def export(self, records: Sequence[RunlaneObservationRecord]) -> None:
        # A batch comes again after the endpoint accepted it when the checkpoint could not be advanced (a
        # storage outage at that moment): its records are not mapped twice. Mapped again, an attempt's span
        # went out a second time under the same id without its start and steps, which the mapping had let go.
        accepted = self._accepted
        items = self.mapping.feed([record for record in records if record.id not in accepted])
        if not items:
            self._accepted = frozenset(record.id for record in records)
            return
        try:
            result = await asyncio.to_thread(self._export, items)
        except BaseException:
            self.mapping.rollback()
            raise
        status = self._answers.status
        if getattr(result, "name", None) != "SUCCESS" or (status is not None and 300 <= status < 400):
            # OpenTelemetry counts any answer below 400 as accepted, but it follows no redirect: the records
            # of a 3xx reached nobody, and a checkpoint past them would lose them.
            self.mapping.rollback()  # the batch is sent again: its records must map as they did
            raise self._refused(len(items))
        self._accepted = frozenset(record.id for record in records)
        self.exported += len(items)

    def _export(self, items: list[Any]) -> Any:
        answers = self._answers
        answers.status = answers.reason = answers.error = answers.retry_after = answers.location = None
        _exporting.active = True
        try:
            return self.exporter.export(items)
        except ValueError as error:  # a request that could not be built (an exporter that lets it escape)
            self._answers.error = error
            return None
        finally:
            _exporting.active = False

    def _refused(self, count: int) -> RunlaneError:
        status, reason = self._answers.status, self._answers.reason
        meta: dict[str, Any] = {"endpoint": self.endpoint, self.what.replace(" ", "_"): count}
        if status is None and isinstance(self._answers.error, ValueError):
            # requests' InvalidHeader or InvalidURL, http.client's Latin-1 encoding of a header: nothing was
            # sent. The library's text is left out, since it quotes the header value (an API key).
            meta["error"] = type(self._answers.error).__name__
            problems = (header_problem(name, value) for name, value in self._answers.headers.items())
            problem = next((found for found in problems if found is not None), None)
            if problem is None:
                problem = f"the HTTP request could not be built ({meta['error']}); check the endpoint and the headers"
            return RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"{self.endpoint} was not sent {count} {self.what}: {problem}. Sending them again cannot help.",
                retryable=False,
                meta=meta,
            )
        if status is None:
            return RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"{self.endpoint} did not accept {count} {self.what} (it could not be reached, or did not answer "
                "in time); the batch is sent again.",
                retryable=True,
                meta=meta,
            )
        meta["http_status"] = status
        answer = f"HTTP {status}" + (f" {reason}" if reason else "")
        if 300 <= status < 400:
            location = self._answers.location
            target = "another URL"
            if location is not None:
                meta["location"] = target = redact_endpoint(location)
            return RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"{self.endpoint} answered {count} {self.what} with {answer}, a redirect to {target}: the OTLP "
                "exporter does not follow redirects, so nothing was delivered and sending them again cannot help. "
                "Set the endpoint to the URL the redirect names (often https:// in place of http://).",
                retryable=False,
                meta=meta,
            )
        if status in _PERMANENT:
            return RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"{self.endpoint} refused {count} {self.what} with {answer}: sending them again cannot help. "
                "Check the endpoint's URL and path, its headers (an API key) and its size limits.",
                retryable=False,
                meta=meta,
            )
        retry_after = self._answers.retry_after
        later = "again"
        if retry_after is not None:
            meta["retry_after_s"] = retry_after
            later = f"again once the {retry_after:g} s it asked for (Retry-After) have passed"
        return RunlaneError(
            ErrorCode.OBSERVATION_EXPORT_FAILED,
            f"{self.endpoint} did not accept {count} {self.what} ({answer}); the batch is sent {later}.",
            retryable=True,
            meta=meta,
        )

    def close(self) -> None:
        """Shut the exporter down (its HTTP session, for the OTLP/HTTP ones)."""
        self.exporter.shutdown()


def _check(
    endpoint: object, signal: Signal, headers: object, timeout: object, service_name: object, attributes: object
) -> tuple[str, dict[str, str], float]:
    """Checks the options of an OTLP/HTTP sink; returns the endpoint (from the environment without one),
    the headers and the timeout in seconds."""
    resolved = resolve_endpoint(endpoint, signal)
    checked = check_headers(headers)
    check_environment_headers(signal)
    seconds = timeout_seconds(timeout)
    check_resource(service_name, attributes)
    return resolved, checked, seconds


def otlp_sink(
    *,
    endpoint: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float | str | timedelta = 10.0,
    service_name: str | None = None,
    resource_attributes: Mapping[str, str] | None = None,
) -> OtlpObservationSink:
    """A sink sending every observation record as a log record to ``endpoint`` (OTLP/HTTP, protobuf).

    ``endpoint`` is the full logs URL (``http://collector:4318/v1/logs``); without one it is read from the
    environment as OpenTelemetry's SDKs read it (``OTEL_EXPORTER_OTLP_LOGS_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``/v1/logs``), else ``DEFAULT_LOGS_ENDPOINT``; ``headers`` go with every
    request (an API key, say); ``timeout`` (a duration such as ``"10s"``, or seconds) bounds one export,
    retries included; ``service_name`` and
    ``resource_attributes`` describe the resource the records come from (without ``service_name``, the
    service is named as ``OTEL_SERVICE_NAME`` says, else ``runlane``).
    """
    url, checked, seconds = _check(endpoint, "logs", headers, timeout, service_name, resource_attributes)
    exporter = OTLPLogExporter(endpoint=url, headers=checked, timeout=seconds)
    return _log_sink(exporter, url, service_name, resource_attributes)


def opentelemetry_sink(
    *,
    exporter: Any,
    service_name: str | None = None,
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
    exporter: Any, endpoint: str, service_name: str | None, attributes: Mapping[str, str] | None
) -> OtlpObservationSink:
    mapping = ObservationLogs(resource=observation_resource(service_name, attributes))
    return OtlpObservationSink(mapping=mapping, exporter=exporter, endpoint=endpoint, what="log records")


def otlp_trace_sink(
    *,
    endpoint: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float | str | timedelta = 10.0,
    service_name: str | None = None,
    resource_attributes: Mapping[str, str] | None = None,
) -> OtlpObservationSink:
    """A sink sending each finished attempt as a span to ``endpoint`` (OTLP/HTTP, protobuf), under the
    trace that triggered its run. Options as for ``otlp_sink()``, with the traces URL
    (``http://collector:4318/v1/traces``; without one ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``/v1/traces``, else ``DEFAULT_TRACES_ENDPOINT``)."""
    url, checked, seconds = _check(endpoint, "traces", headers, timeout, service_name, resource_attributes)
    exporter = OTLPSpanExporter(endpoint=url, headers=checked, timeout=seconds)
    mapping = AttemptSpans(resource=observation_resource(service_name, resource_attributes))
    return OtlpObservationSink(mapping=mapping, exporter=exporter, endpoint=url, what="spans")
