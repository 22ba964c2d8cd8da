"""Option checks shared by the sinks and the ``runlane.toml`` exporter options (no OpenTelemetry
import, so loading the plugin stays cheap)."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Literal

from runlane.durations import duration_seconds
from runlane.errors import ErrorCode, RunlaneError

__all__ = [
    "DEFAULT_LOGS_ENDPOINT",
    "DEFAULT_TRACES_ENDPOINT",
    "check_endpoint",
    "check_environment_headers",
    "check_headers",
    "check_resource",
    "header_problem",
    "redact_endpoint",
    "resolve_endpoint",
    "timeout_seconds",
]

DEFAULT_LOGS_ENDPOINT = "http://localhost:4318/v1/logs"
DEFAULT_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"

Signal = Literal["logs", "traces"]
_DEFAULTS: dict[Signal, str] = {"logs": DEFAULT_LOGS_ENDPOINT, "traces": DEFAULT_TRACES_ENDPOINT}


def _invalid(message: str, field: str) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta={"field": field})


def check_endpoint(endpoint: object, default: str) -> str:
    """An http(s) URL with a host, a valid port if any and no whitespace: what the exporter can send to.
    Checked when the options are (every command that reads the config), not at the first export."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        got = repr(redact_endpoint(endpoint)) if isinstance(endpoint, str) else type(endpoint).__name__
        raise _invalid(f"endpoint must be an http(s) URL such as {default}, got {got}.", "endpoint")
    problem = None
    if any(char.isspace() for char in endpoint):
        problem = "has whitespace in it (percent-encode a space in a path as %20)"
    else:
        try:
            parts = urllib.parse.urlsplit(endpoint)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
        except ValueError:
            problem = "has a port that is not a number from 0 to 65535"
        else:
            if not parts.hostname:
                problem = "names no host"
    if problem is not None:
        got = repr(redact_endpoint(endpoint))
        raise _invalid(f"endpoint {got} {problem}; give an http(s) URL such as {default}.", "endpoint")
    return endpoint


def resolve_endpoint(endpoint: object, signal: Signal) -> str:
    """``endpoint`` checked, or without one (``None``) the endpoint OpenTelemetry's SDKs read from the
    environment: ``OTEL_EXPORTER_OTLP_LOGS_ENDPOINT`` (``..._TRACES_...``) as it is, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``/v1/logs`` (``/v1/traces``) appended, else the local Collector's.
    That endpoint is refused when ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or the signal's) names another protocol
    than ``http/protobuf``: it would be a gRPC endpoint, which an HTTP request never reaches."""
    default = _DEFAULTS[signal]
    if endpoint is not None:
        return check_endpoint(endpoint, default)
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = os.environ.get(name, "").strip()
        if not protocol:
            continue
        if protocol != "http/protobuf":
            # The endpoint of the environment is then that of another protocol (gRPC's port 4317, say).
            raise _invalid(
                f"No endpoint is set and {name} is {protocol!r}, but this exporter sends OTLP/HTTP with protobuf "
                f"(http/protobuf): set endpoint to the Collector's OTLP/HTTP URL, such as {default}.",
                "endpoint",
            )
        break
    for name, path in ((f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", ""), ("OTEL_EXPORTER_OTLP_ENDPOINT", signal)):
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        resolved = f"{value.removesuffix('/')}/v1/{path}" if path else value
        try:
            return check_endpoint(resolved, default)
        except RunlaneError as error:
            message = f"No endpoint is set, so it is read from {name}: {error.message} Fix {name}, or set endpoint."
            raise _invalid(message, "endpoint") from None
    return default


# An HTTP field name is a token (RFC 9110, section 5.1).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A control character other than a tab: http.client and requests refuse a value with a line break.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def header_problem(name: object, value: object) -> str | None:
    """What is wrong with one header an HTTP library would refuse to send (``None`` when nothing is),
    naming the header but never quoting its value (an API key, a token)."""
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        if not isinstance(name, str):
            return f"a header name must be a string, got {type(name).__name__}"
        # Not quoted: a name such as "x-api-key: k3y" holds the value.
        return (
            "a header name is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only, without "
            "spaces or a ':'); write the name alone as the key, such as 'x-api-key', and the value as its value"
        )
    if not isinstance(value, str):
        return f"header {name!r} must have a string value, got {type(value).__name__}"
    if value.endswith(("\n", "\r")):
        problem = "ends with a line break (as a value read from a file often does); strip it"
    elif _CONTROL.search(value):
        problem = "has a line break or another control character; remove it"
    elif value != value.strip(" \t"):
        problem = "starts or ends with a space; strip it"
    elif any(ord(char) > 0xFF for char in value):
        problem = "has a character an HTTP header cannot carry (header values are Latin-1 text); encode it"
    else:
        return None
    return f"the value of header {name!r} {problem}"


def check_headers(headers: object) -> dict[str, str]:
    """``headers`` as a dict, refusing one an HTTP library would refuse when sending: that failure is
    local, not an unreachable endpoint, and sending again cannot help."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise _invalid(
            f"headers must map header names to strings, such as {{'x-api-key': '...'}}, got {type(headers).__name__}.",
            "headers",
        )
    for name, value in headers.items():
        problem = header_problem(name, value)
        if problem is not None:
            raise _invalid(f"headers: {problem}.", "headers")
    return dict(headers)


# How OpenTelemetry's exporters read OTEL_EXPORTER_OTLP_HEADERS (``opentelemetry.util.re``, liberal mode):
# comma-separated ``name=value`` parts, a value URL-encoded (or, liberally, any printable ASCII with spaces).
_ENV_DELIMITER = re.compile(r"[ \t]*,[ \t]*")
_ENV_NAME = r"[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+"
_ENV_STRICT = re.compile(rf"[ \t]*({_ENV_NAME})[ \t]*=[ \t]*([\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*)[ \t]*")
_ENV_LIBERAL = re.compile(rf"[ \t]*({_ENV_NAME})[ \t]*=[ \t]*([\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*)[ \t]*")


def check_environment_headers(signal: Signal) -> None:
    """Refuse the headers of ``OTEL_EXPORTER_OTLP_LOGS_HEADERS`` (``..._TRACES_...``), else of
    ``OTEL_EXPORTER_OTLP_HEADERS``, the variable OpenTelemetry's exporter reads, when a part of it is no
    header the exporter can send. The exporter itself would drop such a part and log a warning quoting
    it, API key and all; this names the variable and the part's place (and its header name, once it has
    one) but never its text."""
    name = f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS"
    text = os.environ.get(name)
    if not text:
        name, text = "OTEL_EXPORTER_OTLP_HEADERS", os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")
    for number, part in enumerate(_ENV_DELIMITER.split(text), start=1):
        if not part:
            continue
        strict = _ENV_STRICT.fullmatch(part.strip())
        match = strict or _ENV_LIBERAL.fullmatch(part.strip())
        if match is None:
            raise _invalid(
                f"{name}: part {number} is not a header written as name=value (the value URL-encoded, parts "
                "separated by commas, such as x-api-key=KEY,authorization=Bearer%20TOKEN); OpenTelemetry's "
                "exporter would leave it out. Its text is not shown, as it may hold a key.",
                "headers",
            )
        header, value = match.group(1), match.group(2)
        if strict is not None:
            header, value = urllib.parse.unquote(header), urllib.parse.unquote(value)
        problem = header_problem(header.strip().lower(), value.strip())
        if problem is not None:
            raise _invalid(f"{name}: {problem}.", "headers")


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
    if service_name is not None and (not isinstance(service_name, str) or not service_name):
        raise _invalid("service_name must be a non-empty string.", "service_name")
    if attributes is not None and (
        not isinstance(attributes, Mapping)
        or not all(isinstance(key, str) and key and isinstance(value, str) for key, value in attributes.items())
    ):
        raise _invalid(
            "resource_attributes must map attribute names to strings, such as {'service.namespace': 'jobs'}.",
            "resource_attributes",
        )
