"""Option checks shared by the sinks and the ``runlane.toml`` exporter options (no OpenTelemetry
import, so loading the plugin stays cheap)."""

from __future__ import annotations

from collections.abc import Mapping

from runlane.durations import duration_seconds
from runlane.errors import ErrorCode, RunlaneError

__all__ = ["DEFAULT_LOGS_ENDPOINT", "DEFAULT_TRACES_ENDPOINT", "check_endpoint", "check_resource", "timeout_seconds"]

DEFAULT_LOGS_ENDPOINT = "http://localhost:4318/v1/logs"
DEFAULT_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"


def _invalid(message: str, field: str) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta={"field": field})


def check_endpoint(endpoint: object, default: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise _invalid(f"endpoint must be an http(s) URL such as {default}, got {endpoint!r}.", "endpoint")
    return endpoint


def timeout_seconds(timeout: object) -> float:
    """``timeout`` as seconds: a duration (``"10s"``, ``"500ms"``, a ``timedelta``) or a positive number
    of seconds."""
    return duration_seconds(timeout, "timeout")


def check_resource(service_name: object, attributes: object) -> None:
    if not isinstance(service_name, str) or not service_name:
        raise _invalid("service_name must be a non-empty string.", "service_name")
    if attributes is not None and (
        not isinstance(attributes, Mapping)
        or not all(isinstance(key, str) and key and isinstance(value, str) for key, value in attributes.items())
    ):
        raise _invalid(
            "resource_attributes must map attribute names to strings, such as {'service.namespace': 'jobs'}.",
            "resource_attributes",
        )
