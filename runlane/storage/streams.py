"""Ordered append streams: the persisted head, record, key and index layout shared by every writer.

Drivers with native append and core's point-write fallback use the same layout, so both kinds of
writer can work on one store. Positions are positive unsigned 64-bit integers exposed as decimal
strings; record keys and sort values use the fixed-width sortable form.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ErrorCode, RunlaneError
from ..json_values import canonical_json, canonical_json_of_checked
from .codecs import (
    MAX_UNSIGNED_64,
    UNSIGNED_64_WIDTH,
    encode_storage_tuple,
    encode_storage_unsigned_integer,
    format_unsigned_64_decimal,
    parse_unsigned_64_decimal,
)
from .indexes import StorageIndexName
from .types import (
    STORAGE_DOCUMENT_SCHEMA_VERSION,
    NewStorageRecord,
    StorageAppendCommand,
    StorageDocument,
    StorageIndexEntry,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    measure_storage_record,
)

# The canonical envelope of an empty value: the only document whose value gains no comma when a field
# is added to it.
_EMPTY_ENVELOPE = canonical_json({"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": {}})

__all__ = [
    "AppendValueShape",
    "MaterializedStorageAppend",
    "StorageStreamLayout",
    "encode_storage_append_value",
    "materialize_storage_append",
    "measure_storage_append",
    "read_storage_stream_position",
    "storage_append_rows",
    "storage_append_templates",
    "storage_stream_layouts",
]


@dataclass(frozen=True, slots=True)
class StorageStreamLayout:
    stream: StorageStreamName
    head_collection: str
    record_collection: str
    index: StorageIndexName
    position_field: str

    def head_key(self, partition: str) -> StorageRecordKey:
        if type(partition) is str:
            return _head_key(self.head_collection, partition)  # keys are immutable: one per partition
        return StorageRecordKey(self.head_collection, partition)

    def record_key(self, partition: str, position: int) -> StorageRecordKey:
        return StorageRecordKey(self.record_collection, partition, encode_storage_unsigned_integer(position))

    def owns_key(self, key: StorageRecordKey, partition: str) -> bool:
        """Whether ``key`` is this stream's head or one of its records in ``partition``."""
        return key.collection in (self.head_collection, self.record_collection) and key.parts[0] == partition

    def head_record(self, partition: str, next_position: int) -> NewStorageRecord:
        # The one value is a decimal string: canonical without walking it (one head per append).
        value = {"next_position": format_unsigned_64_decimal(next_position)}
        text = canonical_json_of_checked({"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": value})
        return NewStorageRecord._trusted(_head_key(self.head_collection, partition), StorageDocument(text, len(text)))

    def stream_record(self, partition: str, position: int, value: dict[str, Any]) -> NewStorageRecord:
        self._check_value(value)
        document = StorageDocument.encode({**value, self.position_field: format_unsigned_64_decimal(position)})
        entry = StorageIndexEntry(self.index, (partition,), (encode_storage_unsigned_integer(position),))
        return NewStorageRecord(self.record_key(partition, position), document, (entry,))

    def _check_value(self, value: dict[str, Any]) -> None:
        if self.position_field in value:
            raise RunlaneError(
                ErrorCode.ADAPTER_CONTRACT_VIOLATION,
                f"Appended values must omit {self.position_field!r}; storage assigns positions at commit.",
            )

    def _check_document(self, document: StorageDocument) -> None:
        """``_check_value`` of a document's value, parsing it only when its text could hold the field."""
        if _field_member_prefix(self.position_field) in document.text:
            self._check_value(document.value)


@functools.lru_cache(maxsize=256)
def _head_key(collection: str, partition: str) -> StorageRecordKey:
    return StorageRecordKey(collection, partition)


class AppendValueShape:
    """What ``encode_storage_append_value`` remembers on a document: its value's greatest top-level key."""

    __slots__ = ("last_key",)

    def __init__(self, last_key: str | None) -> None:
        self.last_key = last_key


def encode_storage_append_value(value: dict[str, Any], *, checked: bool = False) -> StorageDocument:
    """The canonical document of one append value: ``StorageDocument.encode(value)``.

    The document remembers its value's greatest top-level key, so materializing it can splice the
    position field into the text when that field sorts last, instead of parsing and encoding the
    value again. ``checked=True`` is for values built from validated models (JSON-safe by
    construction): they are encoded without walking them again.
    """
    if not isinstance(value, dict):
        return StorageDocument.encode(value)  # raises the contract error
    document: StorageDocument | None = None
    if checked:
        try:
            text = canonical_json_of_checked({"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": value})
            document = StorageDocument(text, len(text.encode("utf-8")))
        except (ValueError, TypeError):  # UnicodeEncodeError is a ValueError; the validating path explains it
            document = None
    if document is None:
        document = StorageDocument.encode(value)
    # Keys are strings here: the encoders above reject anything else.
    return document.remember_decoded(AppendValueShape(max(value) if value else None))


storage_stream_layouts: dict[StorageStreamName, StorageStreamLayout] = {
    StorageStreamName.OBSERVATIONS: StorageStreamLayout(
        stream=StorageStreamName.OBSERVATIONS,
        head_collection="observation_stream_heads",
        record_collection="observation_records",
        index=StorageIndexName.OBSERVATION_STREAM,
        position_field="stream_position",
    )
}


def read_storage_stream_position(head: StorageRecord | None) -> int:
    """The next position to allocate: 1 for an absent head; a corrupt or exhausted head fails."""
    if head is None:
        return 1
    value = head.document.value
    raw = value.get("next_position") if set(value) == {"next_position"} else None
    try:
        position = parse_unsigned_64_decimal(raw) if isinstance(raw, str) else None
    except RunlaneError:
        position = None
    if position is None:
        where = "/".join((head.key.collection, *head.key.parts))
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"The stream head record {where} is corrupt (its document must be exactly "
            '{"next_position": "<decimal>"}); refusing to allocate positions, so nothing can be appended to '
            "the stream. Restore the record from a backup, or set next_position to one past the stream's "
            "highest stored position.",
            meta={"key": head.key.encoded, "record": where},
        )
    return position


@dataclass(frozen=True, slots=True)
class MaterializedStorageAppend:
    head: NewStorageRecord
    records: tuple[NewStorageRecord, ...]
    first_position: int
    last_position: int


def materialize_storage_append(command: StorageAppendCommand, start_position: int) -> MaterializedStorageAppend:
    """The head and records for ``command`` starting at ``start_position`` (contiguous positions).

    Each record is exactly ``layout.stream_record(partition, position, document.value)``, built without
    checking the value again: the command's documents are canonical JSON, and adding one decimal
    string keeps them so.
    """
    layout = storage_stream_layouts[command.stream]
    partition = command.partition
    partition_tuple = (partition,)
    key_prefix, encoded_partition, rows = storage_append_rows(command, start_position)
    collection = layout.record_collection
    index = layout.index
    records = tuple(
        [
            NewStorageRecord._trusted(
                StorageRecordKey._trusted(collection, (partition, sort), key_prefix + sort_hex),
                StorageDocument(text, size),
                (StorageIndexEntry._trusted(index, partition_tuple, (sort,), encoded_partition, sort_hex),),
            )
            for sort, sort_hex, text, size in rows
        ]
    )
    last = start_position + len(rows) - 1
    return MaterializedStorageAppend(layout.head_record(partition, last + 1), records, start_position, last)


def storage_append_rows(
    command: StorageAppendCommand, start_position: int
) -> tuple[str, str, list[tuple[str, str, str, int]]]:
    """The raw records of ``command`` starting at ``start_position``, for drivers that store rows.

    Returns ``(key prefix, encoded index partition, rows)`` where each row is ``(sort, encoded sort,
    document text, document byte size)``: the record's key encodes as ``key prefix + encoded sort``
    and its one index row is ``(layout.index, encoded index partition, encoded sort)``, exactly the
    record ``materialize_storage_append`` builds at that position.
    """
    layout = storage_stream_layouts[command.stream]
    count = len(command.values)
    last = start_position + count - 1
    # The head stores the next position, which must itself fit the unsigned 64-bit range.
    if start_position < 1 or last + 1 > MAX_UNSIGNED_64:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"The {command.stream.value} stream is exhausted: positions must stay within the unsigned 64-bit range.",
        )
    key_prefix, encoded_partition = _record_prefixes(layout.record_collection, command.partition)
    field = layout.position_field
    member = _field_member_prefix(field)
    rows = []
    position = start_position
    for document in command.values:
        # Every position is in range (checked above), so plain decimal text is its canonical form.
        digits = str(position)
        position += 1
        spliced = _splice(document, field, member)
        if spliced is not None:
            before, size = spliced
            text = f'{before}{digits}"}}}}'
            size += len(digits)
        else:
            value = json.loads(document.text)["value"]
            layout._check_value(value)
            value[field] = digits
            text = canonical_json_of_checked({"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": value})
            size = len(text.encode("utf-8"))
        sort = digits.rjust(UNSIGNED_64_WIDTH, "0")
        rows.append((sort, sort.encode("ascii").hex(), text, size))
    return key_prefix, encoded_partition, rows


def storage_append_templates(command: StorageAppendCommand) -> list[tuple[str, str, int]] | None:
    """For each value of ``command``: its record's document text before and after the position
    digits, and the document's byte size without them, so that ``before + digits + after`` is the
    text ``storage_append_rows`` writes at any position (for drivers that allocate positions where
    the records are stored). ``None`` when some value's text is rebuilt at each position instead."""
    field = storage_stream_layouts[command.stream].position_field
    member = _field_member_prefix(field)
    templates = []
    for document in command.values:
        spliced = _splice(document, field, member)
        if spliced is None:
            return None
        before, size = spliced
        templates.append((before, '"}}', size))
    return templates


def _splice(document: StorageDocument, field: str, member: str) -> tuple[str, int] | None:
    """When the position ``field`` sorts after every key of the value (the shape remembered by
    ``encode_storage_append_value``), the canonical text gains it as the value's last member: the
    text up to the position digits, and the byte size without them. ``None`` otherwise."""
    shape = document.decoded
    if type(shape) is not AppendValueShape or not (shape.last_key is None or shape.last_key < field):
        return None
    added = f'{"" if shape.last_key is None else ","}{member}"'
    # ASCII; the closing quote after the digits is new, the closing braces were counted already
    return f"{document.text[:-2]}{added}", document.byte_size + len(added) + 1


@functools.lru_cache(maxsize=256)
def _record_prefixes(collection: str, partition: str) -> tuple[str, str]:
    """The encoded ``(collection, partition)`` key prefix (with its separator) and encoded index partition."""
    return encode_storage_tuple((collection, partition)) + "/", encode_storage_tuple((partition,))


@functools.lru_cache(maxsize=64)
def _field_member_prefix(field: str) -> str:
    return canonical_json(field) + ":"


@functools.lru_cache(maxsize=256)
def _widest_sizes(stream: StorageStreamName, partition: str) -> tuple[int, int]:
    """``(bytes a record adds to its value's document, head bytes)`` at the widest position of a partition."""
    widest = MAX_UNSIGNED_64 - 1
    assert len(str(widest)) == UNSIGNED_64_WIDTH
    layout = storage_stream_layouts[stream]
    sort = encode_storage_unsigned_integer(widest)
    fixed = len(layout.record_key(partition, widest).encoded)
    fixed += len(layout.index) + len(encode_storage_tuple((partition,))) + len(encode_storage_tuple((sort,)))
    fixed += len(_field_member_prefix(layout.position_field)) + len(canonical_json(format_unsigned_64_decimal(widest)))
    return fixed, measure_storage_record(layout.head_record(partition, widest))


def measure_storage_append(command: StorageAppendCommand) -> tuple[int, int, Sequence[int]]:
    """Records (head included), total bytes and per-record bytes at the widest possible position.

    Sizes are computed, not encoded: a record is its value's canonical document plus one
    ``"<position field>":"<digits>"`` member (and a comma unless the value is empty), a fixed-width
    key and one index row, all ASCII apart from the value itself.
    """
    layout = storage_stream_layouts[command.stream]
    fixed, head_size = _widest_sizes(command.stream, command.partition)
    per_record = []
    for document in command.values:
        layout._check_document(document)
        comma = 0 if document.text == _EMPTY_ENVELOPE else 1
        per_record.append(fixed + document.byte_size + comma)
    return len(per_record) + 1, head_size + sum(per_record), per_record
