"""Query cursors: opaque continuation tokens bound to the exact query scope that produced them.

A cursor binds its schema version, index, partition, range and direction plus the last returned
sort value and record key. Decoding against any other scope is rejected with ``validation_failed``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from ..errors import ErrorCode, RunlaneError
from ..vocabulary import SortDirection
from .codecs import decode_storage_tuple
from .types import StorageQuery

__all__ = ["StorageQueryPosition", "decode_storage_query_cursor", "encode_storage_query_cursor"]

_CURSOR_VERSION = 1


@dataclass(frozen=True, slots=True)
class StorageQueryPosition:
    """Where a page ended: the encoded sort value and encoded record key of its last item."""

    sort: str
    key: str


def _scope(query: StorageQuery) -> dict[str, object]:
    return {
        "index": query.index.value,
        "partition": query.encoded_partition,
        "range": query.range.to_json(),
        "direction": SortDirection(query.direction).value,
    }


def encode_opaque_token(payload: dict[str, Any]) -> str:
    """Unpadded URL-safe base64 of canonical JSON: the wire form of every Runlane cursor."""
    raw = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return base64.urlsafe_b64encode(raw.encode("utf-8")).decode("ascii").rstrip("=")


def decode_opaque_token(token: object) -> Any:
    """The JSON payload of a token made by ``encode_opaque_token``, or ``None`` when it is not one.

    Only the exact encoder output is accepted: base64 decoding alone would silently skip stray
    characters, accept ``+``/``/`` and padding, so a damaged token could still look valid.
    """
    if not isinstance(token, str) or not token or not token.isascii():
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        if base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=") != token:
            return None
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (binascii.Error, ValueError, UnicodeDecodeError, RecursionError):
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def encode_storage_query_cursor(query: StorageQuery, position: StorageQueryPosition) -> str:
    return encode_opaque_token({"v": _CURSOR_VERSION, **_scope(query), "sort": position.sort, "key": position.key})


def _invalid(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.VALIDATION_FAILED, message, meta={"field": "cursor"})


def decode_storage_query_cursor(query: StorageQuery) -> StorageQueryPosition | None:
    """The position of ``query.cursor`` (``None`` when absent); any scope mismatch is rejected."""
    cursor = query.cursor
    if cursor is None:
        return None
    payload = decode_opaque_token(cursor)
    if not isinstance(payload, dict):
        raise _invalid("Malformed cursor: pass back the whole next_cursor value unchanged.")
    version = payload.get("v")
    if type(version) is not int or version != _CURSOR_VERSION:
        raise _invalid("Malformed cursor: unknown cursor version.")
    expected = _scope(query)
    for name, value in expected.items():
        if payload.get(name) != value:
            raise _invalid(f"This cursor belongs to a different query ({name} differs); restart without a cursor.")
    sort, key = payload.get("sort"), payload.get("key")
    if not isinstance(sort, str) or not isinstance(key, str):
        raise _invalid("Malformed cursor: missing position.")
    try:
        decode_storage_tuple(sort)
        decode_storage_tuple(key)
    except RunlaneError:
        raise _invalid("Malformed cursor: corrupt position.") from None
    return StorageQueryPosition(sort=sort, key=key)
