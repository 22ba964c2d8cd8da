"""Option checks shared by the sinks and the ``runlane.toml`` exporter options (no OpenTelemetry
import, so loading the plugin stays cheap)."""

from __future__ import annotations

from collections.abc import Mapping

from runlane.durations import duration_seconds
from runlane.errors import ErrorCode, RunlaneError

__all__ = [
    "DEFAULT_LOGS_ENDPOINT",
    "DEFAULT_TRACES_ENDPOINT",
    "check_endpoint",
    "check_resource",
    "redact_endpoint",
    "timeout_seconds",
]

DEFAULT_LOGS_ENDPOINT = "http://localhost:4318/v1/logs"
DEFAULT_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"


def _invalid(message: str, field: str) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta={"field": field})


def check_endpoint(endpoint: object, default: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        got = repr(redact_endpoint(endpoint)) if isinstance(endpoint, str) else type(endpoint).__name__
        raise _invalid(f"endpoint must be an http(s) URL such as {default}, got {got}.", "endpoint")
    return endpoint


def redact_endpoint(endpoint: str) -> str:
    """``endpoint`` for messages: its scheme, host, port and path, with the user name and password
    (``***@``), every query value (``?api_key=***``) and any fragment masked.

    The credentials end at the last ``@`` before the query (the first ``?`` or ``#`` after the first
    ``/``), so a password with an unencoded ``/``, ``?``, ``#`` or ``@`` is masked whole; an ``@`` in
    the path is taken for the end of credentials too, masking more than needed rather than less."""
    scheme, separator, rest = endpoint.partition("://")
    if not separator:
        scheme, rest = "", endpoint
    slash = rest.find("/")
    if slash < 0:
        head_end = len(rest)
    else:
        head_end = min([len(rest)] + [index for index in (rest.find("?", slash), rest.find("#", slash)) if index >= 0])
    at = rest.rfind("@", 0, head_end)
    userinfo = at >= 0
    if userinfo:
        rest = rest[at + 1 :]
    rest, hashed, _ = rest.partition("#")
    location, questioned, query = rest.partition("?")
    text = (scheme + separator if separator else "") + ("***@" if userinfo else "") + location
    if questioned:
        pieces = [piece.partition("=")[0] + "=***" if "=" in piece else "***" for piece in query.split("&") if piece]
        text += "?" + "&".join(pieces)
    if hashed:
        text += "#***"
    return text


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
