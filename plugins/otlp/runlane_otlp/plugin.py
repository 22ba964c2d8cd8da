"""runlane-otlp's plugin: the ``otlp`` and ``otlp-traces`` exporters of ``runlane.toml``::

    [[exporters]]
    use = "otlp"                      # every observation record as a log record
    consumer = "otel_logs"
    endpoint = "${OTEL_EXPORTER_OTLP_LOGS_ENDPOINT:-http://localhost:4318/v1/logs}"
    # headers = { "x-api-key" = "${TELEMETRY_API_KEY}" }
    # service_name = "billing-workers"
    # resource_attributes = { "service.namespace" = "jobs" }
    # timeout = 10

    [[exporters]]
    use = "otlp-traces"               # every finished attempt as a span
    consumer = "otel_traces"
    endpoint = "${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-http://localhost:4318/v1/traces}"

``runlane export`` then sends them. Loading the plugin does not import OpenTelemetry; creating an
exporter does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from runlane.plugins import hookimpl
from runlane.plugins.registries import ExporterProvider, ProviderContext

if TYPE_CHECKING:
    from .sink import OtlpObservationSink

__all__ = ["OtlpExporterOptions", "OtlpTracesExporterOptions", "register_exporters"]


class OtlpExporterOptions(BaseModel):
    """Options of ``[[exporters]] use = "otlp"`` (log records)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = "http://localhost:4318/v1/logs"
    headers: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(default=10.0, gt=0)
    service_name: str = Field(default="runlane", min_length=1)
    resource_attributes: dict[str, str] = Field(default_factory=dict)


class OtlpTracesExporterOptions(OtlpExporterOptions):
    """Options of ``[[exporters]] use = "otlp-traces"`` (attempt spans)."""

    endpoint: str = "http://localhost:4318/v1/traces"


def create_otlp_exporter(options: OtlpExporterOptions, context: ProviderContext) -> OtlpObservationSink:
    from .sink import otlp_sink, otlp_trace_sink

    create = otlp_trace_sink if isinstance(options, OtlpTracesExporterOptions) else otlp_sink
    return create(
        endpoint=options.endpoint,
        headers=options.headers,
        timeout=options.timeout,
        service_name=options.service_name,
        resource_attributes=options.resource_attributes,
    )


@hookimpl
def register_exporters(register: Callable[[ExporterProvider], None]) -> None:
    register(ExporterProvider("otlp", OtlpExporterOptions, create_otlp_exporter))
    register(ExporterProvider("otlp-traces", OtlpTracesExporterOptions, create_otlp_exporter))
