"""runlane-otlp's plugin: the ``otlp`` exporter of ``runlane.toml``::

    [[exporters]]
    use = "otlp"
    consumer = "tracing"
    endpoint = "${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-http://localhost:4318/v1/traces}"
    # headers = { "x-api-key" = "${TRACING_API_KEY}" }
    # service_name = "billing-workers"
    # timeout = 10

``runlane export`` then sends every finished attempt as a span. Loading the plugin does not import
OpenTelemetry; creating the exporter does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from runlane.plugins import hookimpl
from runlane.plugins.registries import ExporterProvider, ProviderContext

if TYPE_CHECKING:
    from .sink import OtlpObservationSink

__all__ = ["OtlpExporterOptions", "register_exporters"]


class OtlpExporterOptions(BaseModel):
    """Options of ``[[exporters]] use = "otlp"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = "http://localhost:4318/v1/traces"
    headers: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(default=10.0, gt=0)
    service_name: str = Field(default="runlane", min_length=1)


def create_otlp_exporter(options: OtlpExporterOptions, context: ProviderContext) -> OtlpObservationSink:
    from .sink import otlp_sink

    return otlp_sink(
        endpoint=options.endpoint,
        headers=options.headers,
        timeout=options.timeout,
        service_name=options.service_name,
    )


@hookimpl
def register_exporters(register: Callable[[ExporterProvider], None]) -> None:
    register(ExporterProvider("otlp", OtlpExporterOptions, create_otlp_exporter))
