"""What the span and the log mappings share: the instrumentation scope, the resource, timestamps and
the W3C ``traceparent`` of a run's trigger."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from datetime import datetime
from typing import Any, TypeVar

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from runlane import __version__

__all__ = ["ABSENT", "DEFAULT_SERVICE_NAME", "SCOPE", "nanos", "observation_resource", "parent_context", "restore"]

SCOPE = InstrumentationScope("runlane", __version__)

ABSENT = object()
"""In a mapping's undo journal: the key was not there before."""

_K = TypeVar("_K")
_V = TypeVar("_V")


def restore(table: MutableMapping[_K, _V], before: Mapping[_K, Any]) -> None:
    """Put back what ``before`` (key -> value as it was, or ``ABSENT``) recorded of ``table``."""
    for key, value in before.items():
        if value is ABSENT:
            table.pop(key, None)
        else:
            table[key] = value


DEFAULT_SERVICE_NAME = "runlane"


def observation_resource(service_name: str | None = None, attributes: Mapping[str, str] | None = None) -> Resource:
    """The resource telemetry is sent under: ``service.name`` plus ``attributes`` (and, as in every
    OpenTelemetry SDK, what ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` add). Without a
    ``service_name`` (nor one in ``attributes``), the service is named as ``OTEL_SERVICE_NAME`` or
    ``OTEL_RESOURCE_ATTRIBUTES`` say, else ``runlane``."""
    explicit = dict(attributes or {})
    if service_name is not None:
        explicit = {"service.name": service_name, **explicit}
    resource = Resource.create(explicit)
    named = str(resource.attributes.get("service.name", ""))
    if "service.name" not in explicit and named.startswith("unknown_service"):
        # The SDK's own fallback (no name anywhere): name it after Runlane instead.
        resource = Resource.create({**explicit, "service.name": DEFAULT_SERVICE_NAME})
    return resource


def nanos(value: datetime) -> int:
    return int(value.timestamp() * 1_000_000) * 1_000


def parent_context(carrier: Mapping[str, str] | None) -> SpanContext | None:
    """The remote parent in a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``), if valid."""
    value = (carrier or {}).get("traceparent")
    if not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0x01))
