"""Value types of the storage driver contract: keys, documents, records, queries, profile and limits.

Everything here is immutable. Documents hold canonical JSON text, so handing the same document to a
driver, a cache or a caller never shares mutable state; ``StorageDocument.value`` parses a fresh copy.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import ErrorCode, RunlaneError
from ..json_values import canonical_json_of_checked, ensure_json_value
from ..vocabulary import SortDirection
from .codecs import decode_storage_tuple, encode_storage_tuple, encode_storage_tuple_prefix_upper_bound
from .indexes import StorageIndexName

__all__ = [
    "NewStorageRecord",
    "STORAGE_DOCUMENT_SCHEMA_VERSION",
    "StorageAppendCommand",
    "StorageCandidateMode",
    "StorageClockAuthority",
    "StorageDocument",
    "StorageDurability",
    "StorageIndexConsistency",
    "StorageIndexEntry",
    "StorageIndexRef",
    "StorageLimitError",
    "StorageLimits",
    "StorageProfile",
    "StorageQuery",
    "StorageQueryResult",
    "StorageRange",
    "StorageRecord",
    "StorageRecordKey",
    "StorageStreamName",
    "create_storage_limit_error",
    "have_equal_storage_record_keys",
    "measure_storage_record",
]

STORAGE_DOCUMENT_SCHEMA_VERSION = 1

StorageTuple = tuple[str, ...]


def _contract(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.ADAPTER_CONTRACT_VIOLATION, message)


_set = object.__setattr__


def _as_tuple(value: Sequence[str], what: str) -> StorageTuple:
    if type(value) is tuple and value and all(type(item) is str for item in value):
        return value  # the common case, checked without the generic Sequence machinery
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise _contract(f"{what} must be a non-empty tuple of strings.")
    result = tuple(value)
    for item in result:
        if not isinstance(item, str):
            raise _contract(f"{what} components must be strings, got {type(item).__name__}.")
    return result


# ---------------------------------------------------------------------------------------------
# Keys


@dataclass(frozen=True, slots=True)
class StorageRecordKey:
    """A logical record key: a collection name plus one or more id components."""

    collection: str
    parts: StorageTuple
    # Computed once: keys are hashed, compared and encoded on every driver path.
    encoded: str = field(compare=False, repr=False)

    def __init__(self, collection: str, *parts: str) -> None:
        if not isinstance(collection, str) or not collection:
            raise _contract("A storage record key needs a non-empty collection name.")
        checked = _as_tuple(parts, "Storage record key parts")
        object.__setattr__(self, "collection", collection)
        object.__setattr__(self, "parts", checked)
        object.__setattr__(self, "encoded", encode_storage_tuple((collection, *checked)))

    @classmethod
    def _trusted(cls, collection: str, parts: StorageTuple, encoded: str) -> StorageRecordKey:
        """A key from already-checked parts and their ``encode_storage_tuple((collection, *parts))``.

        For core's hot paths, which build keys from validated ids with cached encodings; everything
        else uses the validating constructor.
        """
        key = object.__new__(cls)
        _set(key, "collection", collection)
        _set(key, "parts", parts)
        _set(key, "encoded", encoded)
        return key

    @classmethod
    def decode(cls, encoded: str) -> StorageRecordKey:
        components = decode_storage_tuple(encoded)
        if len(components) < 2 or not components[0]:
            raise _contract(f"Malformed storage record key {encoded!r}.")
        # A canonical encoding decodes to parts that encode back to it exactly.
        return cls._trusted(components[0], components[1:], encoded)

    def __repr__(self) -> str:
        return f"StorageRecordKey({self.collection!r}, {', '.join(repr(p) for p in self.parts)})"


def have_equal_storage_record_keys(left: StorageRecordKey, right: StorageRecordKey) -> bool:
    return left.collection == right.collection and left.parts == right.parts


# ---------------------------------------------------------------------------------------------
# Documents


class StorageDocument:
    """An immutable canonical envelope ``{"schemaVersion": 1, "value": {...}}``."""

    __slots__ = ("_text", "_byte_size", "_decoded")

    def __init__(self, text: str, byte_size: int) -> None:
        self._text = text
        self._byte_size = byte_size
        self._decoded: Any = None

    def remember_decoded(self, decoded: Any) -> StorageDocument:
        """Attach the immutable decoded form a codec built this document from (or decoded it into),
        so the same codec can skip parsing it again. Only the owning codec reads it back."""
        self._decoded = decoded
        return self

    @property
    def decoded(self) -> Any:
        return self._decoded

    @classmethod
    def encode(cls, value: dict[str, Any]) -> StorageDocument:
        """Validate a JSON object (finite numbers, no cycles) and freeze its canonical envelope."""
        if not isinstance(value, dict):
            raise _contract("A storage document value must be a JSON object.")
        ensure_json_value(value, "storage document", code=ErrorCode.ADAPTER_CONTRACT_VIOLATION)
        text = canonical_json_of_checked({"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": value})
        return cls(text, len(text.encode("utf-8")))

    @classmethod
    def parse(cls, text: str) -> StorageDocument:
        """Parse stored envelope text; anything but a canonical schema-version-1 object is corruption."""
        # Fast path: text this library wrote is canonical, and a strict parse that re-encodes to the
        # very same text proves it (a duplicate key, a number orjson reads differently, or a lone
        # surrogate would not). Anything else takes the precise path below.
        try:
            envelope = orjson.loads(text)
        except (orjson.JSONDecodeError, TypeError):
            envelope = None
        if (
            type(envelope) is dict
            and len(envelope) == 2
            and type(envelope.get("value")) is dict
            and type(envelope.get("schemaVersion")) is int
            and envelope["schemaVersion"] == STORAGE_DOCUMENT_SCHEMA_VERSION
            and canonical_json_of_checked(envelope) == text
        ):
            return cls(text, len(text) if text.isascii() else len(text.encode("utf-8")))
        try:
            envelope = json.loads(
                text,
                parse_constant=_reject_constant,
                parse_float=_parse_finite_float,
                object_pairs_hook=_reject_duplicate_keys,
            )
        except (ValueError, TypeError, RecursionError) as error:
            raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "A stored document is not valid JSON.", cause=error) from None
        if not isinstance(envelope, dict) or set(envelope) != {"schemaVersion", "value"}:
            raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "A stored document is not a Runlane document envelope.")
        version = envelope["schemaVersion"]
        # Exactly the integer 1: ``1.0`` or ``true`` compare equal in Python but are other JSON values.
        if type(version) is not int or version != STORAGE_DOCUMENT_SCHEMA_VERSION:
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"Unsupported document schema version {version!r}; only version 1 is readable.",
            )
        if not isinstance(envelope["value"], dict):
            raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "A stored document value must be a JSON object.")
        try:
            canonical = canonical_json_of_checked(envelope)
            byte_size = len(canonical.encode("utf-8"))
        except (ValueError, RecursionError) as error:  # UnicodeEncodeError (lone surrogate escapes) is a ValueError
            raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "A stored document is not valid JSON text.", cause=error) from None
        return cls(canonical, byte_size)

    @property
    def text(self) -> str:
        return self._text

    @property
    def byte_size(self) -> int:
        return self._byte_size

    @property
    def value(self) -> dict[str, Any]:
        """A fresh, caller-owned copy of the document value."""
        return json.loads(self._text)["value"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorageDocument) and other._text == self._text

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        preview = self._text if len(self._text) <= 80 else self._text[:77] + "..."
        return f"StorageDocument({preview})"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _parse_finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # ``1e400`` parses to infinity
        raise ValueError(f"number {text} is out of the finite range")
    return number


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate object key")
    return result


# ---------------------------------------------------------------------------------------------
# Records and index entries


@dataclass(frozen=True, slots=True)
class StorageIndexEntry:
    """One index row of a record: equality ``partition`` and ordered ``sort``."""

    name: StorageIndexName
    partition: StorageTuple
    sort: StorageTuple
    encoded_partition: str = field(compare=False, repr=False)
    encoded_sort: str = field(compare=False, repr=False)

    def __init__(self, name: StorageIndexName | str, partition: Sequence[str], sort: Sequence[str]) -> None:
        if type(name) is StorageIndexName:
            index_name = name
        else:
            try:
                index_name = StorageIndexName(name)
            except ValueError:
                raise _contract(f"Unknown storage index name {name!r}; the index catalog is closed.") from None
        checked_partition = _as_tuple(partition, "Index partition")
        checked_sort = _as_tuple(sort, "Index sort value")
        _set(self, "name", index_name)
        _set(self, "partition", checked_partition)
        _set(self, "sort", checked_sort)
        _set(self, "encoded_partition", encode_storage_tuple(checked_partition))
        _set(self, "encoded_sort", encode_storage_tuple(checked_sort))

    @classmethod
    def _trusted(
        cls,
        name: StorageIndexName,
        partition: StorageTuple,
        sort: StorageTuple,
        encoded_partition: str,
        encoded_sort: str,
    ) -> StorageIndexEntry:
        """An entry from already-checked tuples and their encodings (core's hot paths only)."""
        entry = object.__new__(cls)
        _set(entry, "name", name)
        _set(entry, "partition", partition)
        _set(entry, "sort", sort)
        _set(entry, "encoded_partition", encoded_partition)
        _set(entry, "encoded_sort", encoded_sort)
        return entry


@dataclass(frozen=True, slots=True)
class NewStorageRecord:
    """What core hands a driver: a key, a canonical document and all of the record's index entries."""

    key: StorageRecordKey
    document: StorageDocument
    indexes: tuple[StorageIndexEntry, ...] = ()

    def __init__(self, key: StorageRecordKey, document: StorageDocument, indexes: Iterable[StorageIndexEntry] = ()) -> None:
        if not isinstance(key, StorageRecordKey):
            raise _contract("A storage record needs a StorageRecordKey.")
        if not isinstance(document, StorageDocument):
            raise _contract("A storage record needs a StorageDocument (use StorageDocument.encode).")
        entries = tuple(indexes)
        seen: set[StorageIndexName] = set()
        for entry in entries:
            if not isinstance(entry, StorageIndexEntry):
                raise _contract("Index entries must be StorageIndexEntry values.")
            if entry.name in seen:
                raise _contract(f"A record may have at most one entry in index {entry.name.value!r}.")
            seen.add(entry.name)
        _set(self, "key", key)
        _set(self, "document", document)
        _set(self, "indexes", entries)

    @classmethod
    def _trusted(
        cls, key: StorageRecordKey, document: StorageDocument, indexes: tuple[StorageIndexEntry, ...] = ()
    ) -> NewStorageRecord:
        """A record whose key, document and (at most one per index) entries core built itself."""
        record = object.__new__(cls)
        _set(record, "key", key)
        _set(record, "document", document)
        _set(record, "indexes", indexes)
        return record


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """A committed record with its opaque positive-decimal ``version``."""

    key: StorageRecordKey
    version: str
    document: StorageDocument
    indexes: tuple[StorageIndexEntry, ...] = ()

    @classmethod
    def _trusted(
        cls, key: StorageRecordKey, version: str, document: StorageDocument, indexes: tuple[StorageIndexEntry, ...]
    ) -> StorageRecord:
        """``StorageRecord(key, version, document, indexes)`` for a driver's own checked values."""
        record = object.__new__(cls)
        _set(record, "key", key)
        _set(record, "version", version)
        _set(record, "document", document)
        _set(record, "indexes", indexes)
        return record


def measure_storage_record(record: NewStorageRecord | StorageRecord) -> int:
    """Bytes a record counts against record and transaction limits (key + document + index rows)."""
    size = len(record.key.encoded) + record.document.byte_size
    for entry in record.indexes:
        # ``name`` is a ``StrEnum`` member: its length is the length of its value.
        size += len(entry.name) + len(entry.encoded_partition) + len(entry.encoded_sort)
    return size


# ---------------------------------------------------------------------------------------------
# Queries


class StorageCandidateMode(enum.StrEnum):
    ADVISORY = "advisory"
    EXCLUSIVE = "exclusive"


@dataclass(frozen=True, slots=True)
class StorageRange:
    """Bounds over *encoded* sort values: at most one lower (``gt``/``gte``) and one upper (``lt``/``lte``)."""

    gt: str | None = None
    gte: str | None = None
    lt: str | None = None
    lte: str | None = None

    def __post_init__(self) -> None:
        if self.gt is not None and self.gte is not None:
            raise _contract("A storage range takes at most one lower bound (gt or gte).")
        if self.lt is not None and self.lte is not None:
            raise _contract("A storage range takes at most one upper bound (lt or lte).")
        for bound in (self.gt, self.gte, self.lt, self.lte):
            if bound is not None and not isinstance(bound, str):
                raise _contract("Storage range bounds are encoded sort strings.")

    @classmethod
    def between(
        cls,
        lower: Sequence[str] | None = None,
        upper: Sequence[str] | None = None,
        *,
        lower_inclusive: bool = True,
        upper_inclusive: bool = False,
    ) -> StorageRange:
        low = None if lower is None else encode_storage_tuple(lower)
        high = None if upper is None else encode_storage_tuple(upper)
        return cls(
            gte=low if lower_inclusive else None,
            gt=None if lower_inclusive else low,
            lte=high if upper_inclusive else None,
            lt=None if upper_inclusive else high,
        )

    @classmethod
    def prefix(cls, prefix: Sequence[str]) -> StorageRange:
        """Every sort tuple that starts with ``prefix`` (inclusive)."""
        return cls(gte=encode_storage_tuple(prefix), lt=encode_storage_tuple_prefix_upper_bound(prefix))

    def contains(self, encoded_sort: str) -> bool:
        if self.gt is not None and not encoded_sort > self.gt:
            return False
        if self.gte is not None and not encoded_sort >= self.gte:
            return False
        if self.lt is not None and not encoded_sort < self.lt:
            return False
        if self.lte is not None and not encoded_sort <= self.lte:
            return False
        return True

    def to_json(self) -> dict[str, str]:
        return {name: value for name in ("gt", "gte", "lt", "lte") if (value := getattr(self, name)) is not None}


@dataclass(frozen=True, slots=True)
class StorageQuery:
    """One ordered page of one index partition; results order by encoded sort, then encoded key."""

    index: StorageIndexName
    partition: StorageTuple
    range: StorageRange = field(default_factory=StorageRange)
    direction: SortDirection = SortDirection.ASC
    limit: int = 100
    cursor: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "index", StorageIndexName(self.index))
        except ValueError:
            raise _contract(f"Unknown storage index name {self.index!r}; the index catalog is closed.") from None
        object.__setattr__(self, "partition", _as_tuple(self.partition, "Query partition"))
        if not isinstance(self.range, StorageRange):
            raise _contract("A storage query range must be a StorageRange.")
        try:
            object.__setattr__(self, "direction", SortDirection(self.direction))
        except ValueError:
            raise _contract(f"Unknown sort direction {self.direction!r}; use 'asc' or 'desc'.") from None
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise RunlaneError(ErrorCode.VALIDATION_FAILED, f"Query limit must be a positive integer, got {self.limit!r}.")

    @property
    def encoded_partition(self) -> str:
        return encode_storage_tuple(self.partition)


@dataclass(frozen=True, slots=True)
class StorageIndexRef:
    """An index candidate: the record key and its sort tuple. Core re-reads the key before deciding."""

    key: StorageRecordKey
    sort: StorageTuple


@dataclass(frozen=True, slots=True)
class StorageQueryResult:
    items: tuple[StorageIndexRef, ...]
    next_cursor: str | None = None


# ---------------------------------------------------------------------------------------------
# Ordered append


class StorageStreamName(enum.StrEnum):
    OBSERVATIONS = "observations"


@dataclass(frozen=True, slots=True)
class StorageAppendCommand:
    """One ordered batch of opaque JSON objects; storage assigns contiguous positions at commit."""

    stream: StorageStreamName
    partition: str
    values: tuple[StorageDocument, ...]

    def __init__(self, stream: StorageStreamName | str, partition: str, values: Iterable[dict[str, Any] | StorageDocument]) -> None:
        try:
            stream_name = StorageStreamName(stream)
        except ValueError:
            raise _contract(f"Unknown storage stream {stream!r}.") from None
        if not isinstance(partition, str) or not partition:
            raise _contract("An append partition must be a non-empty string.")
        frozen = tuple(v if isinstance(v, StorageDocument) else StorageDocument.encode(v) for v in values)
        if not frozen:
            raise _contract("An append command needs at least one value.")
        object.__setattr__(self, "stream", stream_name)
        object.__setattr__(self, "partition", partition)
        object.__setattr__(self, "values", frozen)

    @classmethod
    def _trusted(
        cls, stream: StorageStreamName, partition: str, values: tuple[StorageDocument, ...]
    ) -> StorageAppendCommand:
        """A command from a stream name, a non-empty partition and at least one document (core only)."""
        if not values or not partition or type(partition) is not str:
            return cls(stream, partition, values)  # raises the contract error
        command = object.__new__(cls)
        _set(command, "stream", stream)
        _set(command, "partition", partition)
        _set(command, "values", values)
        return command


# ---------------------------------------------------------------------------------------------
# Profile and limits


class StorageDurability(enum.StrEnum):
    PROCESS = "process"
    DURABLE = "durable"


class StorageClockAuthority(enum.StrEnum):
    CLIENT = "client"
    SERVER_SAMPLED = "server_sampled"
    TRANSACTION_AUTHORITATIVE = "transaction_authoritative"


class StorageIndexConsistency(enum.StrEnum):
    STRONG = "strong"
    EVENTUAL = "eventual"


@dataclass(frozen=True, slots=True)
class StorageLimits:
    max_point_reads: int = 100
    max_query_results: int = 100
    max_record_bytes: int = 400 * 1024
    max_transaction_records: int = 100
    max_transaction_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_point_reads", "max_query_results", "max_record_bytes", "max_transaction_records", "max_transaction_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"Storage limit {name} must be a positive integer.")
        if self.max_transaction_bytes < self.max_record_bytes:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "max_transaction_bytes must be at least max_record_bytes.")
        if self.max_transaction_records * self.max_record_bytes < self.max_transaction_bytes:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                "max_transaction_bytes must be reachable within max_transaction_records records of max_record_bytes each.",
            )


@dataclass(frozen=True, slots=True)
class StorageProfile:
    """What a driver honestly guarantees. A weaker true profile beats a stronger false one."""

    durability: StorageDurability
    clock_authority: StorageClockAuthority
    index_consistency: StorageIndexConsistency
    limits: StorageLimits = field(default_factory=StorageLimits)
    exclusive_candidates: bool = False
    ordered_append: bool = False
    # True when another process cannot construct an equivalent driver that reaches the same state.
    process_local: bool = False


def _limit_meta(limit: str, allowed: int, actual: int, reserved: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"storage_limit": limit, "limit": allowed, "actual": actual}
    if reserved:
        meta["reserved"] = reserved
    return meta


# The limit a driver reports when ids and keys are too long for its indexes (one entry of a native
# index holds a bounded number of bytes); not a profile limit: it depends on how the driver indexes.
INDEX_ENTRY_LIMIT = "max_index_entry_bytes"


class StorageLimitError(RunlaneError):
    """An atomic unit of work exceeded an advertised limit; nothing was committed, so core may split it."""

    def __init__(self, limit: str, allowed: int, actual: int, message: str | None = None, *, reserved: int = 0) -> None:
        """``reserved``: bytes of the limit kept free for later growth, so ``allowed`` is the limit less them."""
        super().__init__(
            ErrorCode.VALIDATION_FAILED,
            message or f"Storage limit {limit} exceeded: {actual} > {allowed}. Nothing was written; split the work.",
            retryable=False,
            meta=_limit_meta(limit, allowed, actual, reserved),
        )
        self.limit = limit
        self.allowed = allowed
        self.actual = actual
        self.reserved = reserved

    def too_large(self, what: str, advice: str = "") -> str:
        """``"<what> is too large to store: N bytes against the lane's <limit> of M."`` and ``advice`` (what to do
        about a large value, from a space); ids and keys too long for the lane's indexes get their own advice."""
        if self.limit == INDEX_ENTRY_LIMIT:
            return (
                f"{what} cannot be stored: its ids and keys need an index entry of {self.actual:,} bytes, over the "
                f"lane's {self.limit} of {self.allowed:,}. Use shorter ids and keys (hash long values)."
            )
        limit = f"the lane's {self.limit} of {self.allowed:,}"
        if self.reserved:
            limit = (
                f"the lane's {self.limit} of {self.allowed + self.reserved:,} less the {self.reserved:,} bytes "
                "a run keeps free for what it records as it runs"
            )
        return f"{what} is too large to store: {self.actual:,} bytes against {limit}.{advice}"


def create_storage_limit_error(limit: str, allowed: int, actual: int) -> StorageLimitError:
    return StorageLimitError(limit, allowed, actual)
