"""JSON values at Runlane boundaries: finite numbers, string keys, no cycles; one canonical encoding."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from .errors import ErrorCode, RunlaneError

__all__ = [
    "JsonObject",
    "JsonValue",
    "canonical_json",
    "ensure_json_object",
    "ensure_json_value",
    "is_json_value",
    "is_unicode_text",
    "json_value_problem",
    "nested_too_deeply",
    "non_finite_float_path",
    "json_escape_char",
    "shown_path",
    "terminal_safe_json",
]

JsonValue = Any  # None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]
JsonObject = dict[str, Any]


class _InvalidJson(Exception):
    def __init__(self, path: str, reason: str, value: Any = None) -> None:
        super().__init__(reason)
        self.path = path
        self.reason = reason
        self.value = value  # the value that is not JSON, when its type is the reason


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` can be stored as UTF-8 (lone surrogates cannot)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Integers up to this size always fit Python's int-to-str digit limit (4300 digits by default).
_MAX_INT_BITS = 4000


def _writable(value: int) -> bool:
    try:
        str(value)
    except ValueError:
        return False
    return True


# How deep a JSON value may nest (arrays and objects in one another). A stored document wraps the value in
# a few levels of its own, and the encoders stop at 255 levels: refused here, a deeper value is the
# caller's error, instead of a failure of the write that stores it.
MAX_JSON_DEPTH = 200


def nested_too_deeply(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON (lists and dicts in one another) nests more than ``limit`` levels deep, found
    without recursion: how deep a parser itself gets before it gives up varies with the Python release."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _check(value: Any, path: str, active: set[int], depth: int = 0) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if not is_unicode_text(value):
            raise _InvalidJson(path, "strings must be valid Unicode (no lone surrogates)")
        return
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS and not _writable(value):
            raise _InvalidJson(path, "the integer has too many digits to be written as JSON")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _InvalidJson(path, "numbers must be finite (no NaN or Infinity)")
        return
    if isinstance(value, (list, tuple)):
        marker = id(value)
        if marker in active:
            raise _InvalidJson(path, "the value contains a reference cycle")
        if depth >= MAX_JSON_DEPTH:
            raise _InvalidJson(path, f"the value is nested more than {MAX_JSON_DEPTH} levels deep")
        active.add(marker)
        for index, item in enumerate(value):
            _check(item, f"{path}[{index}]", active, depth + 1)
        active.discard(marker)
        return
    if isinstance(value, dict):
        marker = id(value)
        if marker in active:
            raise _InvalidJson(path, "the value contains a reference cycle")
        if depth >= MAX_JSON_DEPTH:
            raise _InvalidJson(path, f"the value is nested more than {MAX_JSON_DEPTH} levels deep")
        active.add(marker)
        for key, item in value.items():
            if not isinstance(key, str):
                raise _InvalidJson(path, f"object keys must be strings, got {type(key).__name__}")
            if not is_unicode_text(key):
                raise _InvalidJson(path, "object keys must be valid Unicode (no lone surrogates)")
            _check(item, f"{path}.{key}", active, depth + 1)
        active.discard(marker)
        return
    raise _InvalidJson(path, f"{type(value).__name__} is not a JSON value", value)


def _validate(value: Any) -> None:
    try:
        _check(value, "$", set())
    except RecursionError:
        raise _InvalidJson("$", "the value is nested too deeply") from None


def non_finite_float_path(value: Any) -> str | None:
    """Where the first NaN or infinite float inside a validated Python value is (``$.a[0]``), or ``None``.

    pydantic's JSON mode turns such a float under an untyped field (``dict``, ``Any``) into ``null``
    without a word; callers check first so that data is refused rather than changed. Looks inside
    dicts, lists, tuples, sets and pydantic models; anything else is left to the JSON dump. Runs on
    every trigger: a recursive check settles the common case (plain JSON-like values, all finite);
    only a value it cannot clear is walked again, keeping the way to each item for the path.
    """
    try:
        if _all_finite(value):
            return None
    except RecursionError:
        pass  # nested too deeply for the quick check: the walk below has no depth limit
    stack: list[tuple[Any, int, Any]] = [(value, -1, None)]  # (item, index of its parent in visited, key)
    visited: list[tuple[int, Any]] = []  # (parent index, key) of every container and hit, for the path
    seen: set[int] = set()
    while stack:
        item, parent, key = stack.pop()
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if isinstance(item, float):
            if math.isfinite(item):
                continue
            visited.append((parent, key))
            return _path_of(visited, len(visited) - 1)
        if id(item) in seen:
            continue
        seen.add(id(item))
        here = len(visited)
        visited.append((parent, key))
        if isinstance(item, dict):
            stack.extend((child, here, name) for name, child in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((child, here, index) for index, child in enumerate(item))
        elif isinstance(item, (set, frozenset)):
            stack.extend((child, here, _MEMBER) for child in item)
        elif (fields := getattr(type(item), "__pydantic_fields__", None)) is not None:
            stack.extend((getattr(item, name, None), here, name) for name in fields)
            extra = getattr(item, "__pydantic_extra__", None) or {}
            stack.extend((child, here, name) for name, child in extra.items())
    return None


_MEMBER: Any = object()  # the key of a set member in a path: ``[]``


def _all_finite(value: Any) -> bool:
    """``True`` when ``value`` surely holds no NaN or infinity; ``False`` for a hit or anything it does
    not look into (sets, other types), which the full walk then settles."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is dict:
        children: Any = value.values()
    elif kind is list or kind is tuple:
        children = value
    elif getattr(kind, "__pydantic_fields__", None) is not None and kind.__pydantic_root_model__ is False:
        children = value.__dict__.values()
        extra = value.__pydantic_extra__
        if extra and not all(_all_finite(child) for child in extra.values()):
            return False
    else:
        return False
    for child in children:
        if not _all_finite(child):
            return False
    return True


def _path_of(visited: list[tuple[int, Any]], at: int) -> str:
    parts = []
    while at > 0:  # entry 0 is the value itself: ``$``
        parent, key = visited[at]
        parts.append("[]" if key is _MEMBER else f"[{key}]" if isinstance(key, int) else f".{key}")
        at = parent
    return "$" + "".join(reversed(parts))


def is_json_value(value: Any) -> bool:
    return json_value_problem(value) is None


def json_value_problem(value: Any) -> tuple[str, str, Any] | None:
    """Where ``value`` first stops being JSON (``$.a[0]``), why, and the value there when its type is why;
    ``None`` for a JSON value."""
    try:
        _validate(value)
    except _InvalidJson as problem:
        return shown_path(problem.path), problem.reason, problem.value
    return None


_SHOWN_PATH_CHARS = 200


def shown_path(path: str) -> str:
    """A value's path (``$.a[0]``) as a message names it: its keys come from the caller's data, and a value
    nested hundreds of levels deep has a path as long, so a long one is cut short rather than making the
    message as large as the data."""
    return path if len(path) <= _SHOWN_PATH_CHARS else path[: _SHOWN_PATH_CHARS - 1] + "…"


def ensure_json_value(value: Any, what: str = "value", *, code: ErrorCode = ErrorCode.VALIDATION_FAILED) -> Any:
    """Return ``value`` when it is JSON-safe, else raise ``RunlaneError`` saying where and why."""
    problem = json_value_problem(value)
    if problem is not None:
        path, reason, _ = problem
        raise RunlaneError(
            code,
            f"Invalid {what}: {reason} at {path}. Use JSON values: null, booleans, finite numbers, strings, lists and string-keyed objects.",
            meta={"field": what, "path": path},
        )
    return value


def ensure_json_object(value: Any, what: str = "value", *, code: ErrorCode = ErrorCode.VALIDATION_FAILED) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RunlaneError(code, f"Invalid {what}: expected a JSON object.", meta={"field": what})
    return ensure_json_value(value, what, code=code)


def canonical_json(value: Any) -> str:
    """Canonical text: sorted keys, no whitespace, UTF-8 characters kept, finite numbers only.

    The caller must pass a value already checked by ``ensure_json_value`` (cycles would recurse).
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json_of_checked(value: Any) -> str:
    """``canonical_json`` for a value already proven JSON-safe (same text, several times faster).

    Only for values that passed ``ensure_json_value`` or were dumped from validated models: the fast
    encoder would write a non-finite number as ``null`` instead of refusing it.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except orjson.JSONEncodeError:
        # Integers beyond 64 bits (valid JSON) and lone surrogates take the standard encoder, which
        # produces the same text or raises the precise error.
        return canonical_json(value)


def json_escape_char(match: re.Match[str]) -> str:
    """The ``\\uXXXX`` escape of the one character ``match`` found (a UTF-16 surrogate pair past U+FFFF, as
    ``json.dumps(ensure_ascii=True)`` writes it)."""
    code = ord(match.group())
    if code > 0xFFFF:
        code -= 0x10000
        return f"\\u{0xD800 | code >> 10:04x}\\u{0xDC00 | code & 0x3FF:04x}"
    return f"\\u{code:04x}"


# What a terminal acts on that JSON leaves as it is: DEL, the C1 controls (\x9b starts a control sequence on
# many terminals, as ESC [ does), and the characters that reorder or break lines (bidi controls, U+2028/9).
_TERMINAL_ACTIVE = re.compile(r"[\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def terminal_safe_json(text: str) -> str:
    """JSON text with those characters written as ``\\uXXXX`` escapes: the same JSON value, which no
    terminal it is printed to can be made to act on."""
    return _TERMINAL_ACTIVE.sub(json_escape_char, text)
