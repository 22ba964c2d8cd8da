"""Public identifier rules: ids and keys are opaque, non-empty strings without ``:``.

``:`` is reserved so storage can compose internal keys without colliding with public ids.
"""

from __future__ import annotations

from .errors import ErrorCode, RunlaneError

__all__ = ["MAX_ID_LENGTH", "is_valid_id", "validate_id", "validate_optional_id"]

MAX_ID_LENGTH = 512


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and ":" not in value


def validate_id(value: object, what: str = "id", *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> str:
    """Return ``value`` when it is a valid public id, else raise ``RunlaneError`` naming ``what``."""
    if not isinstance(value, str):
        raise RunlaneError(code, f"Invalid {what}: expected a string, got {type(value).__name__}.", meta={"field": what})
    if not value:
        raise RunlaneError(code, f"Invalid {what}: it must not be empty.", meta={"field": what})
    if ":" in value:
        raise RunlaneError(
            code,
            f"Invalid {what} {value!r}: ':' is reserved; use '.', '_' or a hashed segment instead.",
            meta={"field": what},
        )
    if len(value) > MAX_ID_LENGTH:
        raise RunlaneError(
            code, f"Invalid {what}: it is longer than {MAX_ID_LENGTH} characters; hash long values.", meta={"field": what}
        )
    return value


def validate_optional_id(value: object, what: str = "id", *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> str | None:
    return None if value is None else validate_id(value, what, code=code)
