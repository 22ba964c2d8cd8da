"""The storage driver contract and core's storage encodings.

This package never imports the core runtime; drivers import only ``runlane.storage`` and
``runlane.errors`` (plus the record models the contract names).
"""

from .codecs import (
    MAX_UNSIGNED_64,
    compare_storage_encoded_values,
    decode_iso_date,
    decode_storage_tuple,
    decode_storage_unsigned_integer,
    encode_iso_date,
    encode_storage_tuple,
    encode_storage_tuple_prefix_upper_bound,
    encode_storage_unsigned_integer,
    format_unsigned_64_decimal,
    parse_unsigned_64_decimal,
)
from .cursor import StorageQueryPosition, decode_storage_query_cursor, encode_storage_query_cursor
from .driver import OperatorReadDriver, StorageDriver, StorageTransaction, supports_operator_reads
from .indexes import StorageIndexName
from .operator import (
    PaginationParams,
    RunEventFilter,
    RunFilter,
    TimeRange,
    clamp_page_limit,
    decode_operator_cursor,
    encode_operator_cursor,
    run_event_matches_filter,
    run_event_sort_value,
    run_matches_filter,
    run_sort_value,
)
from .streams import (
    MaterializedStorageAppend,
    StorageStreamLayout,
    materialize_storage_append,
    measure_storage_append,
    read_storage_stream_position,
    storage_stream_layouts,
)
from .types import (
    STORAGE_DOCUMENT_SCHEMA_VERSION,
    NewStorageRecord,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexRef,
    StorageLimitError,
    StorageLimits,
    StorageProfile,
    StorageQuery,
    StorageQueryResult,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    create_storage_limit_error,
    have_equal_storage_record_keys,
    measure_storage_record,
)

__all__ = [name for name in dir() if not name.startswith("_")]
