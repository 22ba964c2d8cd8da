"""Storage contract value types: documents, index entries, records, ranges, queries, limits and profile."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runlane.errors import ErrorCode, RunlaneError
from runlane.storage import (
    STORAGE_DOCUMENT_SCHEMA_VERSION,
    NewStorageRecord,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimitError,
    StorageLimits,
    StorageProfile,
    StorageQuery,
    StorageRange,
    StorageRecordKey,
    create_storage_limit_error,
    encode_storage_tuple,
    measure_storage_record,
)
from runlane.vocabulary import SortDirection

PROPERTY = settings(max_examples=300, deadline=None)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=10),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(alphabet=st.characters(codec="utf-8"), max_size=6), children, max_size=4),
    ),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(alphabet=st.characters(codec="utf-8"), max_size=6), json_values, max_size=5)


def invariant_violation(text: str) -> None:
    with pytest.raises(RunlaneError) as caught:
        StorageDocument.parse(text)
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION


# ---------------------------------------------------------------------------------------------
# Documents


def test_document_canonical_form():
    document = StorageDocument.encode({"b": 1, "a": {"z": [1, 2.5, None, True], "y": "héllo ✓ 𝄞"}, "": "empty key"})
    expected = '{"schemaVersion":1,"value":{"":"empty key","a":{"y":"héllo ✓ 𝄞","z":[1,2.5,null,true]},"b":1}}'
    assert document.text == expected
    assert document.byte_size == len(expected.encode("utf-8"))
    assert document.byte_size > len(expected)  # non-ASCII kept, counted in UTF-8 bytes
    assert STORAGE_DOCUMENT_SCHEMA_VERSION == 1


def test_document_equality_ignores_input_key_order():
    first = StorageDocument.encode({"a": 1, "b": {"c": 2, "d": 3}})
    second = StorageDocument.encode({"b": {"d": 3, "c": 2}, "a": 1})
    assert first == second
    assert hash(first) == hash(second)
    assert first != StorageDocument.encode({"a": 1})


@PROPERTY
@given(json_objects)
def test_document_round_trips_through_its_text(value):
    document = StorageDocument.encode(value)
    assert document.value == json.loads(json.dumps(value))
    parsed = StorageDocument.parse(document.text)
    assert parsed == document
    assert parsed.byte_size == document.byte_size
    # Non-canonical spacing of the same envelope parses to the same canonical document.
    assert StorageDocument.parse(json.dumps(json.loads(document.text), indent=2, ensure_ascii=True)) == document


def _cycle_in_list():
    value: dict = {"items": []}
    value["items"].append(value["items"])
    return value


def _cycle_in_dict():
    value: dict = {"inner": {}}
    value["inner"]["back"] = value
    return value


@pytest.mark.parametrize(
    "value",
    [
        {"n": math.nan},
        {"n": math.inf},
        {"n": [1, -math.inf]},
        _cycle_in_list(),
        _cycle_in_dict(),
        {1: "int key"},
        {"nested": {None: 1}},
        {"when": __import__("datetime").datetime(2024, 1, 1)},
        {"bytes": b"x"},
        {"set": {1, 2}},
        {"lone surrogate": "\ud800"},
        {"\udfff": "lone surrogate key"},
        ["not", "an", "object"],
        "text",
        None,
    ],
)
def test_document_encode_rejects_non_json(value):
    with pytest.raises(RunlaneError):
        StorageDocument.encode(value)


def test_document_encode_rejects_excessive_nesting_with_a_runlane_error():
    deep: list = []
    current = deep
    for _ in range(10_000):
        child: list = []
        current.append(child)
        current = child
    with pytest.raises(RunlaneError):
        StorageDocument.encode({"deep": deep})


def test_document_value_is_an_independent_copy():
    original = {"list": [1, {"x": 1}], "map": {"k": "v"}}
    document = StorageDocument.encode(original)
    original["list"][1]["x"] = 99  # the caller's input no longer matters
    first = document.value
    first["list"].append("changed")
    first["map"]["k"] = "changed"
    second = document.value
    assert second == {"list": [1, {"x": 1}], "map": {"k": "v"}}
    assert first is not second
    assert first["list"] is not second["list"]


def test_shared_non_cyclic_references_are_allowed():
    shared = {"x": 1}
    document = StorageDocument.encode({"a": shared, "b": shared, "c": [shared, shared]})
    assert document.value == {"a": {"x": 1}, "b": {"x": 1}, "c": [{"x": 1}, {"x": 1}]}


@pytest.mark.parametrize(
    "text",
    [
        '{"schemaVersion":2,"value":{}}',
        '{"schemaVersion":0,"value":{}}',
        '{"schemaVersion":"1","value":{}}',
        '{"schemaVersion":true,"value":{}}',
        '{"schemaVersion":1.0,"value":{}}',
        '{"schemaVersion":null,"value":{}}',
        '{"value":{}}',
        '{"schemaVersion":1}',
        '{"schemaVersion":1,"value":{},"extra":1}',
        '{"schemaVersion":1,"value":[]}',
        '{"schemaVersion":1,"value":"x"}',
        '{"schemaVersion":1,"value":null}',
        '{"schemaVersion":1,"value":{"n":NaN}}',
        '{"schemaVersion":1,"value":{"n":Infinity}}',
        '{"schemaVersion":1,"value":{"n":-Infinity}}',
        '{"schemaVersion":1,"value":{"n":1e400}}',
        '{"schemaVersion":1,"value":{"a":1,"a":2}}',
        '{"schemaVersion":1,"value":{"a":1,"a":1}}',  # canonical but for the repeated key
        '{"schemaVersion":1,"schemaVersion":1,"value":{}}',
        '{"schemaVersion":1,"value":{"s":"\\ud800"}}',
        '{"schemaVersion":1,"value":{}',
        '{"schemaVersion":1,"value":{}} trailing',
        "[]",
        "1",
        "",
        "not json",
        '{"schemaVersion":1,"value":' + "[" * 50_000 + "]" * 50_000 + "}",
    ],
)
def test_document_parse_rejects_other_versions_and_malformed_envelopes(text):
    invariant_violation(text)


# ---------------------------------------------------------------------------------------------
# Index entries and records


def test_index_entry_accepts_catalog_names_only():
    entry = StorageIndexEntry("runs_runnable", ["production", "emails"], ["2024", "run_1"])
    assert entry.name is StorageIndexName.RUNS_RUNNABLE
    assert entry.partition == ("production", "emails")
    assert entry.encoded_partition == encode_storage_tuple(("production", "emails"))
    assert entry.encoded_sort == encode_storage_tuple(("2024", "run_1"))
    for unknown in ("nope", "RUNS_RUNNABLE", "", None, 3):
        with pytest.raises(RunlaneError) as caught:
            StorageIndexEntry(unknown, ("p",), ("s",))
        assert caught.value.code is ErrorCode.ADAPTER_CONTRACT_VIOLATION


@pytest.mark.parametrize("partition, sort", [((), ("s",)), (("p",), ()), ("p", ("s",)), (("p",), [1]), (None, ("s",))])
def test_index_entry_rejects_bad_tuples(partition, sort):
    with pytest.raises(RunlaneError):
        StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, partition, sort)


KEY = StorageRecordKey("runs", "production", "run_1")
DOC = StorageDocument.encode({"x": 1})


def test_record_allows_one_entry_per_index():
    runnable = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("production", "emails"), ("a",))
    delivery = StorageIndexEntry(StorageIndexName.RUNS_NEEDING_DELIVERY, ("production",), ("a",))
    record = NewStorageRecord(KEY, DOC, iter([runnable, delivery]))
    assert record.indexes == (runnable, delivery)
    duplicate = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("production", "media"), ("b",))
    with pytest.raises(RunlaneError) as caught:
        NewStorageRecord(KEY, DOC, [runnable, duplicate])
    assert "runs_runnable" in caught.value.message


def test_record_rejects_wrong_types():
    with pytest.raises(RunlaneError):
        NewStorageRecord("runs/production", DOC)  # type: ignore[arg-type]
    with pytest.raises(RunlaneError):
        NewStorageRecord(KEY, {"x": 1})  # type: ignore[arg-type]
    with pytest.raises(RunlaneError):
        NewStorageRecord(KEY, DOC, [("runs_runnable", ("p",), ("s",))])  # type: ignore[list-item]


def test_record_measurement_counts_key_document_and_index_rows():
    entry = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("production", "emails"), ("a",))
    bare, indexed = NewStorageRecord(KEY, DOC), NewStorageRecord(KEY, DOC, [entry])
    assert measure_storage_record(bare) == len(KEY.encoded) + DOC.byte_size
    assert measure_storage_record(indexed) == measure_storage_record(bare) + len("runs_runnable") + len(entry.encoded_partition) + len(entry.encoded_sort)


# ---------------------------------------------------------------------------------------------
# Ranges and queries


def test_range_rejects_two_lower_or_two_upper_bounds():
    with pytest.raises(RunlaneError):
        StorageRange(gt="61", gte="61")
    with pytest.raises(RunlaneError):
        StorageRange(lt="62", lte="62")
    with pytest.raises(RunlaneError):
        StorageRange(gt=61)  # type: ignore[arg-type]
    assert StorageRange(gt="61", lte="62").to_json() == {"gt": "61", "lte": "62"}


def test_range_bounds_are_honoured():
    values = [encode_storage_tuple((c,)) for c in "abcde"]
    b, d = encode_storage_tuple(("b",)), encode_storage_tuple(("d",))
    select = lambda r: [v for v in values if r.contains(v)]  # noqa: E731
    assert select(StorageRange(gte=b, lte=d)) == values[1:4]
    assert select(StorageRange(gt=b, lt=d)) == values[2:3]
    assert select(StorageRange(gte=b)) == values[1:]
    assert select(StorageRange(lt=d)) == values[:3]
    assert select(StorageRange()) == values
    assert StorageRange.between(("b",), ("d",)) == StorageRange(gte=b, lt=d)
    assert StorageRange.between(("b",), ("d",), lower_inclusive=False, upper_inclusive=True) == StorageRange(gt=b, lte=d)


@pytest.mark.parametrize("limit", [0, -1, True, False, 1.5, "10", None])
def test_query_rejects_non_positive_limits(limit):
    with pytest.raises(RunlaneError) as caught:
        StorageQuery(StorageIndexName.RUNS_RUNNABLE, ("production",), limit=limit)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED


def test_query_normalizes_and_validates_its_scope():
    query = StorageQuery("runs_runnable", ["production", "emails"], direction="desc", limit=1)
    assert query.index is StorageIndexName.RUNS_RUNNABLE
    assert query.partition == ("production", "emails")
    assert query.direction is SortDirection.DESC
    assert query.encoded_partition == encode_storage_tuple(("production", "emails"))
    for bad in (
        {"index": "nope"},
        {"partition": ()},
        {"partition": "production"},
        {"direction": "sideways"},
        {"range": {"gt": "61"}},
    ):
        arguments = {"index": StorageIndexName.RUNS_RUNNABLE, "partition": ("production",), **bad}
        with pytest.raises(RunlaneError):
            StorageQuery(**arguments)


# ---------------------------------------------------------------------------------------------
# Limits and profile


def test_default_limits_match_the_local_reference_profile():
    limits = StorageLimits()
    assert limits.max_point_reads == 100
    assert limits.max_query_results == 100
    assert limits.max_transaction_records == 100
    assert limits.max_record_bytes == 400 * 1024
    assert limits.max_transaction_bytes == 4 * 1024 * 1024


@pytest.mark.parametrize(
    "field", ["max_point_reads", "max_query_results", "max_record_bytes", "max_transaction_records", "max_transaction_bytes"]
)
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "100", None])
def test_limits_must_be_positive_integers(field, value):
    with pytest.raises(RunlaneError) as caught:
        StorageLimits(**{field: value})
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_limits_must_work_together():
    # Transaction bytes must hold at least one maximal record...
    with pytest.raises(RunlaneError):
        StorageLimits(max_record_bytes=1000, max_transaction_bytes=999, max_transaction_records=10)
    # ... and be reachable within max_transaction_records maximal records.
    with pytest.raises(RunlaneError):
        StorageLimits(max_record_bytes=1000, max_transaction_bytes=10_001, max_transaction_records=10)
    StorageLimits(max_record_bytes=1000, max_transaction_bytes=10_000, max_transaction_records=10)
    StorageLimits(max_record_bytes=1000, max_transaction_bytes=1000, max_transaction_records=1)


def test_profile_vocabulary():
    assert [m.value for m in StorageDurability] == ["process", "durable"]
    assert sorted(m.value for m in StorageClockAuthority) == ["client", "server_sampled", "transaction_authoritative"]
    assert [m.value for m in StorageIndexConsistency] == ["strong", "eventual"]
    assert [m.value for m in StorageCandidateMode] == ["advisory", "exclusive"]
    profile = StorageProfile(StorageDurability.PROCESS, StorageClockAuthority.CLIENT, StorageIndexConsistency.STRONG)
    assert profile.limits == StorageLimits()
    assert profile.exclusive_candidates is False
    assert profile.ordered_append is False


def test_storage_limit_error():
    error = create_storage_limit_error("max_transaction_records", 100, 101)
    assert isinstance(error, StorageLimitError) and isinstance(error, RunlaneError)
    assert error.retryable is False
    assert error.meta == {"storage_limit": "max_transaction_records", "limit": 100, "actual": 101}
    assert (error.limit, error.allowed, error.actual) == ("max_transaction_records", 100, 101)
    json.dumps(error.to_json())


def test_written_documents_are_recalled_by_exact_text_and_bounded():
    from runlane.storage import NewStorageRecord, StorageRecordKey
    from runlane.storage.attempt import StagedWrite, WrittenDocuments

    def write(name: str, value: int, expected: str | None = "1") -> StagedWrite:
        key = StorageRecordKey("things", name)
        return StagedWrite(key, expected, NewStorageRecord(key, StorageDocument.encode({"v": value}), ()))

    written = WrittenDocuments(limit=8)
    created = write("new", 1, expected=None)
    written.remember([created])
    assert written.recall(created.key.encoded, created.record.document.text) is None  # creates are not kept

    first = write("a", 1)
    written.remember([first])
    assert written.recall(first.key.encoded, first.record.document.text) is first.record.document
    assert written.recall(first.key.encoded, '{"schemaVersion":1,"value":{"v":2}}') is None  # another text

    written.remember([StagedWrite(first.key, "1", None)])  # a delete forgets it
    assert written.recall(first.key.encoded, first.record.document.text) is None

    writes = [write(f"k{n}", n) for n in range(40)]
    for staged in writes:
        written.remember([staged])
        written.remember([writes[0]])  # written again and again: never the oldest
    kept = [staged for staged in writes if written.recall(staged.key.encoded, staged.record.document.text)]
    assert writes[0] in kept and writes[-1] in kept
    assert 8 <= len(kept) <= 10  # the limit, plus at most a quarter more before the oldest go
    assert writes[1] not in kept


def test_written_documents_stay_within_their_byte_budget_whatever_the_count():
    """A worker keeps the runs it rewrote; runs with large payloads or outputs must not make that the
    last thousands of documents of 400 KiB each (gigabytes), only the newest that fit the budget."""
    from runlane.storage import NewStorageRecord, StorageRecordKey
    from runlane.storage.attempt import StagedWrite, WrittenDocuments

    def write(name: str) -> StagedWrite:
        key = StorageRecordKey("things", name)
        return StagedWrite(key, "1", NewStorageRecord(key, StorageDocument.encode({"blob": "x" * 10_000}), ()))

    written = WrittenDocuments(limit=4096, limit_bytes=100_000)
    writes = [write(f"k{n}") for n in range(100)]
    for staged in writes:
        written.remember([staged])
    kept = [staged for staged in writes if written.recall(staged.key.encoded, staged.record.document.text)]
    assert 9 <= len(kept) <= 12  # 10,035 bytes each: the budget, plus at most a quarter more
    assert kept == writes[-len(kept) :]  # the newest
    assert sum(staged.record.document.byte_size for staged in kept) <= 125_000
