"""Ordered append streams: the persisted head, record, key and index layout shared by every writer.

Drivers with native append and core's point-write fallback use the same layout, so both kinds of
writer can work on one store. Positions are positive unsigned 64-bit integers exposed as decimal
strings; record keys and sort values use the fixed-width sortable form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ErrorCode, RunlaneError
from .codecs import (
    MAX_UNSIGNED_64,
    UNSIGNED_64_WIDTH,
    encode_storage_unsigned_integer,
    format_unsigned_64_decimal,
    parse_unsigned_64_decimal,
)
from .indexes import StorageIndexName
from .types import (
    NewStorageRecord,
    StorageAppendCommand,
    StorageDocument,
    StorageIndexEntry,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    measure_storage_record,
)

__all__ = [
    "MaterializedStorageAppend",
    "StorageStreamLayout",
    "materialize_storage_append",
    "measure_storage_append",
    "read_storage_stream_position",
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
        return StorageRecordKey(self.head_collection, partition)

    def record_key(self, partition: str, position: int) -> StorageRecordKey:
        return StorageRecordKey(self.record_collection, partition, encode_storage_unsigned_integer(position))

    def owns_key(self, key: StorageRecordKey, partition: str) -> bool:
        """Whether ``key`` is this stream's head or one of its records in ``partition``."""
        return key.collection in (self.head_collection, self.record_collection) and key.parts[0] == partition

    def head_record(self, partition: str, next_position: int) -> NewStorageRecord:
        document = StorageDocument.encode({"next_position": format_unsigned_64_decimal(next_position)})
        return NewStorageRecord(self.head_key(partition), document)

    def stream_record(self, partition: str, position: int, value: dict[str, Any]) -> NewStorageRecord:
        if self.position_field in value:
            raise RunlaneError(
                ErrorCode.ADAPTER_CONTRACT_VIOLATION,
                f"Appended values must omit {self.position_field!r}; storage assigns positions at commit.",
            )
        document = StorageDocument.encode({**value, self.position_field: format_unsigned_64_decimal(position)})
        entry = StorageIndexEntry(self.index, (partition,), (encode_storage_unsigned_integer(position),))
        return NewStorageRecord(self.record_key(partition, position), document, (entry,))


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
        raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "The stream head record is corrupt; refusing to allocate positions.")
    return position


@dataclass(frozen=True, slots=True)
class MaterializedStorageAppend:
    head: NewStorageRecord
    records: tuple[NewStorageRecord, ...]
    first_position: int
    last_position: int


def materialize_storage_append(command: StorageAppendCommand, start_position: int) -> MaterializedStorageAppend:
    """The head and records for ``command`` starting at ``start_position`` (contiguous positions)."""
    layout = storage_stream_layouts[command.stream]
    count = len(command.values)
    last = start_position + count - 1
    # The head stores the next position, which must itself fit the unsigned 64-bit range.
    if start_position < 1 or last + 1 > MAX_UNSIGNED_64:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"The {command.stream.value} stream is exhausted: positions must stay within the unsigned 64-bit range.",
        )
    records = tuple(
        layout.stream_record(command.partition, start_position + offset, document.value)
        for offset, document in enumerate(command.values)
    )
    return MaterializedStorageAppend(layout.head_record(command.partition, last + 1), records, start_position, last)


def measure_storage_append(command: StorageAppendCommand) -> tuple[int, int, Sequence[int]]:
    """Records (head included), total bytes and per-record bytes at the widest possible position."""
    widest = MAX_UNSIGNED_64 - 1
    layout = storage_stream_layouts[command.stream]
    per_record = []
    for document in command.values:
        per_record.append(measure_storage_record(layout.stream_record(command.partition, widest, document.value)))
    head_size = measure_storage_record(layout.head_record(command.partition, widest))
    assert len(str(widest)) == UNSIGNED_64_WIDTH
    return len(per_record) + 1, head_size + sum(per_record), per_record
