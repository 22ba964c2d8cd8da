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
from .driver import (
    OperatorReadDriver,
    StorageDriver,
    StorageTransaction,
    StorageWakeHints,
    supports_operator_reads,
    supports_wake_hints,
)
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
    encode_storage_append_value,
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

from .tables import (
    RUN_EVENTS_COLLECTION,
    RUN_TOMBSTONES_COLLECTION,
    RUNS_COLLECTION,
    RunChildCounts,
    decode_run_document,
    decode_run_event_document,
    encode_run_document,
    encode_run_event_document,
    run_event_key,
    run_key,
    run_tombstone_key,
    try_decode_run_document,
    try_decode_run_event_document,
)

# Re-exported so a driver package can import everything it needs from ``runlane.storage`` alone.
from ..models import Environment, Page, RunEventRecord, RunRecord, RunSummary, environment_key
from ..vocabulary import PaginationCursorKind, SortDirection

__all__ = [
    "MAX_UNSIGNED_64", "RUNS_COLLECTION", "RUN_EVENTS_COLLECTION", "RUN_TOMBSTONES_COLLECTION",
    "STORAGE_DOCUMENT_SCHEMA_VERSION", "Environment", "MaterializedStorageAppend", "NewStorageRecord",
    "OperatorReadDriver", "Page", "PaginationCursorKind", "PaginationParams", "RunChildCounts", "RunEventFilter",
    "RunEventRecord", "RunFilter", "RunRecord", "RunSummary", "SortDirection", "StorageAppendCommand",
    "StorageCandidateMode", "StorageClockAuthority", "StorageDocument", "StorageDriver", "StorageDurability",
    "StorageIndexConsistency", "StorageIndexEntry", "StorageIndexName", "StorageIndexRef", "StorageLimitError",
    "StorageLimits", "StorageProfile", "StorageQuery", "StorageQueryPosition", "StorageQueryResult", "StorageRange",
    "StorageRecord", "StorageRecordKey", "StorageStreamLayout", "StorageStreamName", "StorageTransaction", "StorageWakeHints",
    "TimeRange", "clamp_page_limit", "compare_storage_encoded_values", "create_storage_limit_error",
    "decode_iso_date", "decode_operator_cursor", "decode_run_document", "decode_run_event_document",
    "decode_storage_query_cursor", "decode_storage_tuple", "decode_storage_unsigned_integer",
    "encode_iso_date", "encode_operator_cursor", "encode_storage_append_value", "encode_run_document", "encode_run_event_document",
    "encode_storage_query_cursor", "encode_storage_tuple", "encode_storage_tuple_prefix_upper_bound",
    "encode_storage_unsigned_integer", "environment_key", "format_unsigned_64_decimal",
    "have_equal_storage_record_keys", "materialize_storage_append", "measure_storage_append",
    "measure_storage_record", "parse_unsigned_64_decimal", "read_storage_stream_position", "run_event_key",
    "run_event_matches_filter", "run_event_sort_value", "run_key", "run_matches_filter", "run_sort_value",
    "run_tombstone_key", "storage_stream_layouts", "supports_operator_reads", "supports_wake_hints", "try_decode_run_document",
    "try_decode_run_event_document",
]
