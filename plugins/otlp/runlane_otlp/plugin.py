"""runlane-otlp's plugin: the ``otlp`` and ``otlp-traces`` exporters of ``runlane.toml``::

    [[exporters]]
    use = "otlp"                      # every observation record as a log record
    consumer = "otel_logs"
    # endpoint = "http://collector:4318/v1/logs"   # without it: as OTEL_EXPORTER_OTLP_ENDPOINT says
    # headers = { "x-api-key" = "${TELEMETRY_API_KEY}" }
    # service_name = "billing-workers"   # without it: OTEL_SERVICE_NAME, else "runlane"
    # resource_attributes = { "service.namespace" = "jobs" }
    # timeout = "10s"

    [[exporters]]
    use = "otlp-traces"               # every finished attempt as a span
    consumer = "otel_traces"
    # endpoint = "http://collector:4318/v1/traces"

Without ``endpoint``, it is read from the environment as OpenTelemetry's SDKs read it:
``OTEL_EXPORTER_OTLP_LOGS_ENDPOINT`` (``..._TRACES_...``), else ``OTEL_EXPORTER_OTLP_ENDPOINT`` with
``/v1/logs`` (``/v1/traces``) appended, else ``http://localhost:4318``'s. ``runlane export`` then sends
them. Loading the plugin does not import OpenTelemetry; creating an exporter does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runlane.errors import RunlaneError
from runlane.plugins import hookimpl
from runlane.plugins.registries import ExporterProvider, ProviderContext

from .checks import Signal, check_environment_headers, header_problem, resolve_endpoint, timeout_seconds

if TYPE_CHECKING:
    from .sink import OtlpObservationSink

__all__ = ["OtlpExporterOptions", "OtlpTracesExporterOptions", "register_exporters"]


class OtlpExporterOptions(BaseModel):
    """Options of ``[[exporters]] use = "otlp"`` (log records)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    signal: ClassVar[Signal] = "logs"

    # Without one: OTEL_EXPORTER_OTLP_LOGS_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/logs, else localhost.
    endpoint: str | None = Field(default=None, validate_default=True)
    headers: dict[str, str] = Field(default_factory=dict)
    timeout: float = 10.0  # seconds; runlane.toml may say "10s"
    service_name: str | None = Field(default=None, min_length=1)  # None: OTEL_SERVICE_NAME, else "runlane"
    resource_attributes: dict[str, str] = Field(default_factory=dict)

    @field_validator("endpoint", mode="before")
    @classmethod
    def _endpoint(cls, value: object) -> str:
        try:
            return resolve_endpoint(value, cls.signal)
        except RunlaneError as error:
            raise ValueError(error.message) from None

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        # Checked here, so every command refuses a header the exporter could never send (a key read
        # from a file with its line break) instead of `runlane export` retrying it forever.
        for name, text in value.items():
            problem = header_problem(name, text)
            if problem is not None:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _environment_headers(self) -> OtlpExporterOptions:
        # The headers the exporter adds from OTEL_EXPORTER_OTLP_HEADERS: refused here, by every command, as
        # the exporter would leave a malformed one out and log it, key and all.
        try:
            check_environment_headers(self.signal)
        except RunlaneError as error:
            raise ValueError(error.message) from None
        return self

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, value: object) -> float:
        try:
            return timeout_seconds(value)
        except RunlaneError as error:
            raise ValueError(error.message) from None


class OtlpTracesExporterOptions(OtlpExporterOptions):
    """Options of ``[[exporters]] use = "otlp-traces"`` (attempt spans)."""

    signal: ClassVar[Signal] = "traces"


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
