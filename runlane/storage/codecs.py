"""Canonical storage encodings: tuples, record keys, sort values, ISO dates and unsigned 64-bit integers.

A tuple is encoded as the lowercase hexadecimal UTF-8 of each component joined by ``/``. Because ``/``
sorts below every hex digit and each byte is exactly two hex digits, the plain lexical (code point)
order of two encodings equals component-wise UTF-8 byte order of the tuples, with a proper prefix
sorting first. Drivers may therefore compare encoded strings with ``<`` or a ``COLLATE "C"`` btree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime

from ..errors import ErrorCode, RunlaneError

__all__ = [
    "MAX_UNSIGNED_64",
    "UNSIGNED_64_WIDTH",
    "compare_storage_encoded_values",
    "decode_iso_date",
    "decode_storage_tuple",
    "encode_iso_date",
    "encode_storage_tuple",
    "encode_storage_tuple_prefix_upper_bound",
    "encode_storage_unsigned_integer",
    "decode_storage_unsigned_integer",
    "format_unsigned_64_decimal",
    "parse_unsigned_64_decimal",
]

StorageTuple = tuple[str, ...]

MAX_UNSIGNED_64 = 2**64 - 1
UNSIGNED_64_WIDTH = 20  # len(str(MAX_UNSIGNED_64))
_SEPARATOR = "/"


def _contract(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.ADAPTER_CONTRACT_VIOLATION, message)


def encode_storage_tuple(components: Sequence[str]) -> str:
    """Encode a non-empty tuple of strings; order of encodings = component-wise UTF-8 byte order."""
    if isinstance(components, str) or not components:
        raise _contract("A storage tuple needs at least one string component.")
    parts = []
    for component in components:
        if type(component) is not str and not isinstance(component, str):
            raise _contract(f"Storage tuple components must be strings, got {type(component).__name__}.")
        try:
            parts.append(component.encode("utf-8").hex())
        except UnicodeEncodeError:
            raise _contract("Storage tuple components must be valid Unicode (no lone surrogates).") from None
    return _SEPARATOR.join(parts)


def decode_storage_tuple(encoded: str) -> StorageTuple:
    """Inverse of ``encode_storage_tuple``; rejects anything that is not a canonical encoding."""
    if not isinstance(encoded, str):
        raise _contract("An encoded storage tuple must be a string.")
    components = []
    for part in encoded.split(_SEPARATOR):
        # ``fromhex`` also takes upper case and spaces: only text it gives back exactly is canonical.
        try:
            raw = bytes.fromhex(part)
        except ValueError:
            raw = None
        if raw is None or raw.hex() != part:
            raise _contract(f"Malformed storage tuple encoding {encoded!r}.")
        try:
            components.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _contract(f"Malformed storage tuple encoding {encoded!r}: not UTF-8.") from None
    return tuple(components)


def encode_storage_tuple_prefix_upper_bound(prefix: Sequence[str]) -> str:
    """The exclusive upper bound of every tuple that starts with ``prefix``.

    Every such encoding is ``enc(prefix)`` optionally followed by ``/...``; ``0`` is the first
    character above ``/``, so ``enc(prefix) + "0"`` is above all of them and below every tuple whose
    first components differ. No Unicode sentinel is involved, so values starting with U+10FFFF work.
    """
    return encode_storage_tuple(prefix) + "0"


def compare_storage_encoded_values(left: str, right: str) -> int:
    """-1, 0 or 1 for two encodings (plain code point order, which is byte order for ASCII)."""
    return (left > right) - (left < right)


# ---------------------------------------------------------------------------------------------
# ISO dates: fixed width with microseconds and ``Z`` so lexical order is time order (years 0001-9999).


# The last two dates encoded and their text (a write path encodes its transaction time and the
# caller's time for several index entries). Each pair is replaced as a unit and holds its datetime,
# so the identity stays unique while remembered.
_last_encoded: tuple[object, str] = (None, "")
_previous_encoded: tuple[object, str] = (None, "")


def encode_iso_date(value: datetime) -> str:
    global _last_encoded, _previous_encoded
    last = _last_encoded
    if value is last[0]:
        return last[1]
    previous = _previous_encoded
    if value is previous[0]:
        return previous[1]
    text = _encode_iso_date(value)
    _previous_encoded = last
    _last_encoded = (value, text)
    return text


def _encode_iso_date(value: datetime) -> str:
    if type(value) is datetime and value.tzinfo is UTC:
        # The common case, same text: ``YYYY-MM-DDTHH:MM:SS.ffffff+00:00`` with the offset as ``Z``
        # (``isoformat()`` leaves the fraction out when it is zero).
        if value.microsecond:
            return value.isoformat()[:-6] + "Z"
        return value.isoformat()[:-6] + ".000000Z"
    if not isinstance(value, datetime):
        raise _contract(f"Expected a datetime, got {type(value).__name__}.")
    if value.tzinfo is None or value.utcoffset() is None:
        raise _contract("Storage dates must be timezone-aware.")
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise _contract(f"Storage date {value!r} is outside years 0001-9999 in UTC.") from None
    return f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}T{utc.hour:02d}:{utc.minute:02d}:{utc.second:02d}.{utc.microsecond:06d}Z"


_CANONICAL_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")


def decode_iso_date(encoded: str) -> datetime:
    """Inverse of ``encode_iso_date``; only the exact canonical form is accepted."""
    if not isinstance(encoded, str) or len(encoded) != 27 or _CANONICAL_DATE.fullmatch(encoded) is None:
        raise _contract(f"Malformed storage date {encoded!r}.")
    # The pattern fixes every field's width and digits; fromisoformat checks the ranges (month 13,
    # February 30 and the like raise).
    try:
        return datetime.fromisoformat(encoded[:-1]).replace(tzinfo=UTC)
    except ValueError:
        raise _contract(f"Malformed storage date {encoded!r}.") from None


# ---------------------------------------------------------------------------------------------
# Unsigned 64-bit integers: public positions are plain decimal strings; sortable encodings are
# zero-padded to 20 digits so lexical order is numeric order.


def parse_unsigned_64_decimal(value: str, *, positive: bool = True) -> int:
    """Parse a canonical decimal string (no sign, no leading zeros) within the unsigned 64-bit range."""
    if not isinstance(value, str) or not value or not value.isascii() or not value.isdigit():
        raise _contract(f"Malformed unsigned 64-bit decimal {value!r}.")
    if len(value) > 1 and value[0] == "0":
        raise _contract(f"Unsigned 64-bit decimal {value!r} has leading zeros.")
    if len(value) > 20:  # before int(): Python refuses to convert more than 4,300 digits
        raise _contract(f"Unsigned 64-bit decimal {value[:24]!r}... is out of range.")
    number = int(value)
    if number > MAX_UNSIGNED_64:
        raise _contract(f"Unsigned 64-bit decimal {value!r} is out of range.")
    if positive and number == 0:
        raise _contract("Expected a positive unsigned 64-bit decimal, got '0'.")
    return number


def format_unsigned_64_decimal(value: int) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > MAX_UNSIGNED_64:
        raise _contract(f"{value!r} is not an unsigned 64-bit integer.")
    return str(value)


def encode_storage_unsigned_integer(value: int) -> str:
    """Sortable fixed-width form (20 digits) of an unsigned 64-bit integer."""
    return format_unsigned_64_decimal(value).rjust(UNSIGNED_64_WIDTH, "0")


def decode_storage_unsigned_integer(encoded: str) -> int:
    if not isinstance(encoded, str) or len(encoded) != UNSIGNED_64_WIDTH or not encoded.isascii() or not encoded.isdigit():
        raise _contract(f"Malformed sortable unsigned integer {encoded!r}.")
    number = int(encoded)
    if number > MAX_UNSIGNED_64:
        raise _contract(f"Sortable unsigned integer {encoded!r} is out of range.")
    return number
