"""Public identifier rules: ids and keys are opaque, non-empty strings without ``:``.

``:`` is reserved so storage can compose internal keys without colliding with public ids.
"""

from __future__ import annotations

import os
import threading
import time

from .errors import ErrorCode, RunlaneError
from .json_values import is_unicode_text

__all__ = [
    "MAX_ID_LENGTH",
    "is_valid_id",
    "random_bits_128",
    "random_uuid4_hex",
    "time_ordered_uuid_hex",
    "validate_id",
    "validate_optional_id",
]

MAX_ID_LENGTH = 512


def is_valid_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_ID_LENGTH
        and ":" not in value
        and "\x00" not in value
        and is_unicode_text(value)
    )


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
    if "\x00" in value:
        raise RunlaneError(
            code,
            f"Invalid {what} {value!r}: it contains a NUL character (\\x00), which databases cannot store in "
            "text; remove it or hash the value.",
            meta={"field": what},
        )
    if len(value) > MAX_ID_LENGTH:
        raise RunlaneError(
            code, f"Invalid {what}: it is longer than {MAX_ID_LENGTH} characters; hash long values.", meta={"field": what}
        )
    if not is_unicode_text(value):
        raise RunlaneError(
            code,
            f"Invalid {what} {value!r}: it is not valid Unicode text (a lone surrogate, which is what bytes that "
            "are not UTF-8 become in a command line or environment variable); pass UTF-8 text.",
            meta={"field": what},
        )
    return value


def validate_optional_id(value: object, what: str = "id", *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> str | None:
    return None if value is None else validate_id(value, what, code=code)


# ---------------------------------------------------------------------------------------------
# Random identities: the same operating-system randomness as ``uuid.uuid4()``, read in blocks.
#
# Every run id, lease token and event-id base is drawn from ``os.urandom``; one system call per
# identity dominates creating small runs. Each thread keeps its own block of random bytes, and a
# forked child starts with fresh blocks, so a child never repeats identities its parent hands out.

_BLOCK = 4096
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1
    _uuid7.lock = threading.Lock()  # a thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Block(threading.local):
    def __init__(self) -> None:
        self.data = b""
        self.offset = _BLOCK
        self.generation = -1


_block = _Block()


def _random_16() -> bytes:
    block = _block
    offset = block.offset
    if offset >= _BLOCK or block.generation != _fork_generation:
        block.data = os.urandom(_BLOCK)
        block.generation = _fork_generation
        offset = 0
    block.offset = offset + 16
    return block.data[offset : offset + 16]


def random_bits_128() -> int:
    """128 random bits from ``os.urandom``."""
    return int.from_bytes(_random_16())


_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def random_uuid4_hex() -> str:
    """A random version-4 UUID as 32 hex digits: what ``uuid.uuid4().hex`` returns."""
    return f"{(random_bits_128() & _UUID4_CLEAR) | _UUID4_SET:032x}"


_RANDOM_62 = (1 << 62) - 1
_UUID7_VERSION_AND_VARIANT = (0x7 << 76) | (0b10 << 62)
_RANDOM_74 = (1 << 74) - 1
_STEP_BITS = 32  # the random part of each step within one millisecond


class _Uuid7State:
    """The last version-7 UUID this process drew: ``(millis, 74-bit tail, fork generation)``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.millis = -1
        self.tail = 0
        self.generation = -1


_uuid7 = _Uuid7State()


def time_ordered_uuid_hex() -> str:
    """A version-7 UUID (RFC 9562) as 32 hex digits: 48 bits of Unix time in milliseconds, then 74
    bits that are random in a new millisecond (version and variant bits as the RFC sets them).

    Ids drawn in a later millisecond sort after earlier ones, so the B-tree indexes that storage keys
    by them (a run's record, its events, its projection rows) grow at one end and a commit dirties
    a few pages instead of one per run. Within one process they are also strictly increasing (RFC 9562
    section 6.2, method 2): an id drawn in the same millisecond as the previous one, or after the clock
    stepped back, adds a random step to the previous one's tail instead of drawing a new tail, so runs
    triggered one after the other keep their order also when their times are equal (a frozen test
    clock). The random bits keep ids unique without coordination between processes; a forked child
    starts afresh.
    """
    bits = random_bits_128()
    now = (time.time_ns() // 1_000_000) & 0xFFFF_FFFF_FFFF
    state = _uuid7
    with state.lock:
        if now > state.millis or state.generation != _fork_generation:
            millis, tail = now, bits & (_RANDOM_74 >> 1)  # the top bit clear: room for 2**73 more steps
        else:
            millis, tail = state.millis, state.tail + 1 + (bits >> (128 - _STEP_BITS))
            if tail > _RANDOM_74:  # cannot happen before 2**41 ids in one millisecond: move to the next
                millis, tail = millis + 1, bits & (_RANDOM_74 >> 1)
        state.millis, state.tail, state.generation = millis, tail, _fork_generation
    random_a = tail >> 62  # 12 bits after the version
    random_b = tail & _RANDOM_62  # 62 bits after the variant
    return f"{((millis & 0xFFFF_FFFF_FFFF) << 80) | (random_a << 64) | _UUID7_VERSION_AND_VARIANT | random_b:032x}"
