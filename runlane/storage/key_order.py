"""Index entries that restate their record's key, for drivers that keep index rows in a table.

Core writes a few index names whose entries restate the record key: a run event ``(environment,
run_id, position)`` carries ``run_events_by_run`` with partition ``(environment, run_id)`` and sort
``(position,)``; a step carries ``run_steps_by_run`` the same way; every ordered-append record carries
its stream's index. For such an entry the encoded key is ``enc((collection,)) + "/" + partition + "/"
+ sort``, so the records' own key order already is the index order within the partition. A SQL driver
may keep no index row for it and read that part of the index as a key range of the records (checking
that each record lists the entry), merged with the rows of entries that do not restate their key.

The decision is per entry and exact, so a record of any other shape under the same index name (a
conformance test's, or one in another collection) is indexed by a row as usual.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .codecs import encode_storage_tuple
from .indexes import StorageIndexName
from .streams import storage_stream_layouts
from .tables import RUN_EVENTS_COLLECTION, RUN_STEPS_COLLECTION

__all__ = [
    "KEY_ORDERED_COLLECTION_PREFIXES",
    "KEY_ORDERED_INDEXES",
    "KeyOrderedRange",
    "key_ordered_range",
    "repeats_key",
]

# Index name -> the collection whose records' keys restate that index's entries.
KEY_ORDERED_INDEXES: Mapping[StorageIndexName, str] = MappingProxyType(
    {
        StorageIndexName.RUN_EVENTS_BY_RUN: RUN_EVENTS_COLLECTION,
        StorageIndexName.RUN_STEPS_BY_RUN: RUN_STEPS_COLLECTION,
        **{layout.index: layout.record_collection for layout in storage_stream_layouts.values()},
    }
)

# Index name value -> the encoded key prefix of that collection's records (``enc((collection,)) + "/"``).
KEY_ORDERED_COLLECTION_PREFIXES: Mapping[str, str] = MappingProxyType(
    {name.value: encode_storage_tuple((collection,)) + "/" for name, collection in KEY_ORDERED_INDEXES.items()}
)


@dataclass(frozen=True, slots=True)
class KeyOrderedRange:
    """Where the records whose keys restate the entries of one key-ordered index partition lie.

    Such a key is ``prefix`` followed by the entry's encoded sort, so every one sorts in
    ``prefix <= key < upper`` (``upper`` is the prefix with its final ``/`` raised to ``0``), a sort
    bound ``b`` is the key bound ``prefix + b``, and the sort is the key from (1-based) ``start`` on.
    """

    prefix: str
    upper: str
    start: int


def key_ordered_range(index: StorageIndexName | str, encoded_partition: str) -> KeyOrderedRange | None:
    """The key range of the records restating ``index`` entries of one partition, or ``None`` when
    ``index`` is not key-ordered."""
    collection = KEY_ORDERED_COLLECTION_PREFIXES.get(index)
    if collection is None:
        return None
    prefix = f"{collection}{encoded_partition}/"
    return KeyOrderedRange(prefix, prefix[:-1] + "0", len(prefix) + 1)


def repeats_key(index: str, encoded_partition: str, encoded_sort: str, encoded_key: str) -> bool:
    """Whether an entry (index name value and encodings) of the record at ``encoded_key`` restates the key."""
    collection = KEY_ORDERED_COLLECTION_PREFIXES.get(index)
    return collection is not None and encoded_key == f"{collection}{encoded_partition}/{encoded_sort}"
