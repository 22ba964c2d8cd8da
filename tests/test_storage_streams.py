"""Ordered append streams: the persisted head, records, keys and indexes shared by every writer."""

from __future__ import annotations

import pytest

from runlane.errors import ErrorCode, RunlaneError
from runlane.storage import (
    MAX_UNSIGNED_64,
    StorageAppendCommand,
    StorageDocument,
    StorageIndexName,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    encode_storage_unsigned_integer,
    materialize_storage_append,
    measure_storage_append,
    measure_storage_record,
    read_storage_stream_position,
    storage_stream_layouts,
)

LAYOUT = storage_stream_layouts[StorageStreamName.OBSERVATIONS]


def command(*values, partition: str = "production") -> StorageAppendCommand:
    return StorageAppendCommand(StorageStreamName.OBSERVATIONS, partition, values or ({"id": "obs_1"},))


def head(value: dict, partition: str = "production") -> StorageRecord:
    return StorageRecord(LAYOUT.head_key(partition), "1", StorageDocument.encode(value))


def test_observation_stream_layout():
    assert StorageStreamName.OBSERVATIONS.value == "observations"
    assert set(storage_stream_layouts) == set(StorageStreamName)
    assert LAYOUT.index is StorageIndexName.OBSERVATION_STREAM
    assert LAYOUT.position_field == "stream_position"
    assert LAYOUT.head_key("production") == StorageRecordKey(LAYOUT.head_collection, "production")
    assert LAYOUT.record_key("production", 7) == StorageRecordKey(LAYOUT.record_collection, "production", "00000000000000000007")
    assert LAYOUT.owns_key(LAYOUT.head_key("production"), "production")
    assert LAYOUT.owns_key(LAYOUT.record_key("production", 1), "production")
    assert not LAYOUT.owns_key(LAYOUT.record_key("staging", 1), "production")
    assert not LAYOUT.owns_key(StorageRecordKey("runs", "production", "run_1"), "production")


def test_materialize_assigns_contiguous_positions_from_the_start():
    append = materialize_storage_append(command({"id": "a"}, {"id": "b"}, {"id": "c"}), 5)
    assert (append.first_position, append.last_position) == (5, 7)
    assert append.head.key == LAYOUT.head_key("production")
    assert append.head.document.value == {"next_position": "8"}
    assert append.head.indexes == ()
    assert [record.key for record in append.records] == [LAYOUT.record_key("production", p) for p in (5, 6, 7)]
    for position, record, original in zip((5, 6, 7), append.records, "abc", strict=True):
        # The position is the decimal string; sortable fixed width only in keys and index rows.
        assert record.document.value == {"id": original, "stream_position": str(position)}
        (entry,) = record.indexes
        assert entry.name is StorageIndexName.OBSERVATION_STREAM
        assert entry.partition == ("production",)
        assert entry.sort == (encode_storage_unsigned_integer(position),)


def test_materialized_records_own_their_values():
    value = {"id": "a", "nested": {"n": 1}}
    append = materialize_storage_append(command(value), 1)
    value["nested"]["n"] = 2
    assert append.records[0].document.value["nested"] == {"n": 1}


def test_read_position_of_absent_and_valid_heads():
    assert read_storage_stream_position(None) == 1
    assert read_storage_stream_position(head({"next_position": "1"})) == 1
    assert read_storage_stream_position(head({"next_position": "42"})) == 42
    assert read_storage_stream_position(head({"next_position": str(MAX_UNSIGNED_64)})) == MAX_UNSIGNED_64


def test_materialized_head_reads_back_as_the_next_position():
    append = materialize_storage_append(command({"id": "a"}, {"id": "b"}), 1)
    stored = StorageRecord(append.head.key, "1", append.head.document)
    assert read_storage_stream_position(stored) == 3
    following = materialize_storage_append(command({"id": "c"}), read_storage_stream_position(stored))
    assert following.first_position == 3


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"next_position": "0"},
        {"next_position": "01"},
        {"next_position": "-1"},
        {"next_position": "+1"},
        {"next_position": " 1"},
        {"next_position": "1.0"},
        {"next_position": "١"},
        {"next_position": 1},
        {"next_position": None},
        {"next_position": "18446744073709551616"},  # exhausted: beyond 2**64 - 1
        {"next_position": "1", "extra": True},
        {"position": "1"},
    ],
)
def test_corrupt_heads_fail(value):
    corrupt = head(value)
    with pytest.raises(RunlaneError) as caught:
        read_storage_stream_position(corrupt)
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION
    # It names the record and what to do about it.
    assert caught.value.meta["key"] == corrupt.key.encoded
    assert f"record {caught.value.meta['record']} is corrupt" in caught.value.message
    assert "Restore the record from a backup" in caught.value.message


def test_exhausted_stream_refuses_to_allocate():
    # The head stores the next position, which itself must fit the unsigned 64-bit range.
    last_possible = materialize_storage_append(command(), MAX_UNSIGNED_64 - 1)
    assert last_possible.last_position == MAX_UNSIGNED_64 - 1
    assert last_possible.head.document.value == {"next_position": str(MAX_UNSIGNED_64)}
    for start, count in ((MAX_UNSIGNED_64, 1), (MAX_UNSIGNED_64 - 1, 2), (MAX_UNSIGNED_64 - 5, 10), (MAX_UNSIGNED_64 + 1, 1)):
        values = [{"id": f"obs_{i}"} for i in range(count)]
        with pytest.raises(RunlaneError) as caught:
            materialize_storage_append(command(*values), start)
        assert caught.value.code is ErrorCode.INVARIANT_VIOLATION


@pytest.mark.parametrize("start", [0, -1])
def test_positions_start_at_one(start):
    with pytest.raises(RunlaneError):
        materialize_storage_append(command(), start)


def test_values_that_carry_the_position_field_are_rejected():
    carrying = command({"id": "a"}, {"id": "b", "stream_position": "9"})
    with pytest.raises(RunlaneError) as caught:
        materialize_storage_append(carrying, 1)
    assert caught.value.code is ErrorCode.ADAPTER_CONTRACT_VIOLATION
    assert "stream_position" in caught.value.message
    with pytest.raises(RunlaneError):
        measure_storage_append(carrying)


def test_measure_counts_the_head_and_the_widest_position():
    values = [{"id": "a"}, {"id": "b" * 300}]
    records, total, per_record = measure_storage_append(command(*values))
    assert records == 3
    assert len(per_record) == 2
    widest = materialize_storage_append(command(*values), MAX_UNSIGNED_64 - 2)
    assert list(per_record) == [measure_storage_record(record) for record in widest.records]
    assert total == sum(per_record) + measure_storage_record(widest.head)
    # Any real allocation is no bigger than the measurement.
    small = materialize_storage_append(command(*values), 1)
    assert all(measure_storage_record(r) <= m for r, m in zip(small.records, per_record, strict=True))
    assert sum(map(measure_storage_record, (small.head, *small.records))) <= total


def test_append_command_validation():
    with pytest.raises(RunlaneError):
        StorageAppendCommand("nope", "production", [{"a": 1}])
    with pytest.raises(RunlaneError):
        StorageAppendCommand(StorageStreamName.OBSERVATIONS, "", [{"a": 1}])
    with pytest.raises(RunlaneError):
        StorageAppendCommand(StorageStreamName.OBSERVATIONS, "production", [])
    with pytest.raises(RunlaneError):
        StorageAppendCommand(StorageStreamName.OBSERVATIONS, "production", [["not", "an", "object"]])
    with pytest.raises(RunlaneError):
        StorageAppendCommand(StorageStreamName.OBSERVATIONS, "production", [{"n": float("nan")}])
    accepted = StorageAppendCommand("observations", "production", [{"a": 1}, StorageDocument.encode({"b": 2})])
    assert accepted.stream is StorageStreamName.OBSERVATIONS
    assert [v.value for v in accepted.values] == [{"a": 1}, {"b": 2}]


def test_append_command_copies_values_at_the_boundary():
    value = {"a": [1]}
    appended = command(value)
    value["a"].append(2)
    assert appended.values[0].value == {"a": [1]}
