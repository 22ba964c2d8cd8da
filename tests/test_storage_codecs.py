"""Canonical storage encodings: tuples, record keys, prefix bounds, ISO dates and unsigned 64-bit integers.

The property tests compare the codecs with the orders they promise (UTF-8 byte order, time order,
numeric order), so a driver that compares encoded strings with ``<`` or a ``COLLATE "C"`` btree
returns exactly the order core expects.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from runlane.errors import ErrorCode, RunlaneError
from runlane.storage import (
    MAX_UNSIGNED_64,
    StorageRange,
    StorageRecordKey,
    compare_storage_encoded_values,
    decode_iso_date,
    decode_storage_tuple,
    decode_storage_unsigned_integer,
    encode_iso_date,
    encode_storage_tuple,
    encode_storage_tuple_prefix_upper_bound,
    encode_storage_unsigned_integer,
    format_unsigned_64_decimal,
    have_equal_storage_record_keys,
    parse_unsigned_64_decimal,
)

PROPERTY = settings(max_examples=300, deadline=None)

# Characters that matter for ordering: NUL, ASCII around the separator and hex digits, the end of
# each UTF-8 length class, the BMP maximum, the first astral character and U+10FFFF.
EDGE_CHARACTERS = ["\x00", "\x01", "/", "0", "9", "a", "f", "\x7f", "\x80", "\u07ff", "\u0800", "é", "\ufffd", "\uffff",
                   "\U00010000", "\U0001f600", "\U0010fffe", "\U0010ffff"]

edge_text = st.text(alphabet=st.sampled_from(EDGE_CHARACTERS), max_size=4)
any_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=8)  # every scalar value, no surrogates
component = st.one_of(edge_text, any_text)
storage_tuple = st.lists(component, min_size=1, max_size=4).map(tuple)


def utf8_key(components: tuple[str, ...]) -> list[bytes]:
    return [part.encode("utf-8") for part in components]


def rejected(call, *args) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        call(*args)
    return caught.value


# ---------------------------------------------------------------------------------------------
# Tuples


@PROPERTY
@given(storage_tuple, storage_tuple)
@example(("",), ("\x00",))
@example(("a",), ("a", ""))
@example(("", "x"), ("\x00",))
@example(("\U0010ffff",), ("\U0010ffff", "\x00"))
@example(("\uffff",), ("\U00010000",))  # UTF-16 order would disagree here
@example(("a/",), ("a", "b"))
def test_encoded_tuple_order_is_component_wise_utf8_byte_order(left, right):
    encoded_left, encoded_right = encode_storage_tuple(left), encode_storage_tuple(right)
    assert (encoded_left < encoded_right) == (utf8_key(left) < utf8_key(right))
    assert (encoded_left == encoded_right) == (left == right)
    expected = (utf8_key(left) > utf8_key(right)) - (utf8_key(left) < utf8_key(right))
    assert compare_storage_encoded_values(encoded_left, encoded_right) == expected


@PROPERTY
@given(storage_tuple)
@example(("",))
@example(("", ""))
@example(("\x00", "\U0010ffff", "𝄞"))
def test_tuple_encoding_round_trips_and_is_lowercase_hex_joined_by_slash(components):
    encoded = encode_storage_tuple(components)
    assert decode_storage_tuple(encoded) == components
    parts = encoded.split("/")
    assert len(parts) == len(components)
    for part, original in zip(parts, components, strict=True):
        assert re.fullmatch(r"(?:[0-9a-f]{2})*", part)
        assert bytes.fromhex(part) == original.encode("utf-8")


def test_tuple_encoding_examples():
    assert encode_storage_tuple(("a", "B")) == "61/42"
    assert encode_storage_tuple(("",)) == ""
    assert encode_storage_tuple(("", "")) == "/"
    assert encode_storage_tuple(["\x00", "\U0010ffff"]) == "00/f48fbfbf"
    assert decode_storage_tuple("/") == ("", "")


@pytest.mark.parametrize(
    "components",
    [(), [], "abc", ("a", 1), ("a", None), ("a", b"b"), ("\ud800",), ("ok", "lone \udfff surrogate")],
)
def test_tuple_encoding_rejects_non_tuples_and_non_unicode(components):
    assert isinstance(rejected(encode_storage_tuple, components), RunlaneError)


@pytest.mark.parametrize(
    "encoded",
    [
        "6",  # odd number of hex digits
        "6G",  # not hex
        "6A",  # uppercase hex is not canonical
        "61 /62",
        " 61",  # spaces and tabs that bytes.fromhex would skip
        "61 ",
        "6\t1",
        "61//6",
        "ff",  # not UTF-8
        "c0af",  # overlong encoding of '/'
        "eda080",  # an encoded surrogate
        "f4908080",  # above U+10FFFF
        "٦١",  # non-ASCII digits
        "0x61",
        None,
        61,
    ],
)
def test_tuple_decoding_rejects_malformed_encodings(encoded):
    rejected(decode_storage_tuple, encoded)


# ---------------------------------------------------------------------------------------------
# Record keys


@PROPERTY
@given(st.one_of(edge_text, any_text).filter(bool), st.lists(component, min_size=1, max_size=3))
def test_record_key_round_trips_and_compares_by_value(collection, parts):
    key = StorageRecordKey(collection, *parts)
    decoded = StorageRecordKey.decode(key.encoded)
    assert decoded == key
    assert hash(decoded) == hash(key)
    assert have_equal_storage_record_keys(decoded, key)
    assert key.encoded == encode_storage_tuple((collection, *parts))
    assert decoded.collection == collection and decoded.parts == tuple(parts)


@PROPERTY
@given(st.lists(component, min_size=2, max_size=4), st.lists(component, min_size=2, max_size=4))
def test_record_key_equality_matches_component_equality(left, right):
    assume(left[0] and right[0])
    left_key, right_key = StorageRecordKey(*left), StorageRecordKey(*right)
    assert (left_key == right_key) == (left == right)
    assert have_equal_storage_record_keys(left_key, right_key) == (left == right)


def test_record_key_rejects_invalid_shapes():
    rejected(StorageRecordKey, "", "a")
    rejected(StorageRecordKey, "runs")
    rejected(StorageRecordKey, "runs", 1)
    rejected(StorageRecordKey, 1, "a")
    rejected(StorageRecordKey.decode, encode_storage_tuple(("runs",)))  # a collection without parts
    rejected(StorageRecordKey.decode, encode_storage_tuple(("", "a")))  # an empty collection
    rejected(StorageRecordKey.decode, "72756e73/zz")


def test_record_keys_are_immutable():
    key = StorageRecordKey("runs", "env", "run_1")
    with pytest.raises(AttributeError):
        key.collection = "other"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Prefix upper bounds

prefix_component = st.one_of(edge_text, any_text, st.text(alphabet=st.sampled_from(["\U0010ffff", "a"]), min_size=1, max_size=3).map(lambda s: "\U0010ffff" + s))


@st.composite
def prefix_and_candidate(draw):
    prefix = tuple(draw(st.lists(prefix_component, min_size=1, max_size=3)))
    kind = draw(st.sampled_from(["extends", "equal", "random", "near"]))
    if kind == "extends":
        candidate = prefix + tuple(draw(st.lists(component, min_size=1, max_size=2)))
    elif kind == "equal":
        candidate = prefix
    elif kind == "near":
        # Share all but the last prefix component, whose value is lengthened or shortened.
        last = prefix[-1]
        changed = draw(st.sampled_from([last + draw(edge_text.filter(bool)), last[:-1], last + "\x00", "\U0010ffff" + last]))
        candidate = prefix[:-1] + (changed,) + tuple(draw(st.lists(component, max_size=2)))
    else:
        candidate = draw(storage_tuple)
    return prefix, candidate


@PROPERTY
@given(prefix_and_candidate())
@example((("\U0010ffff",), ("\U0010ffff", "x")))
@example((("\U0010ffff",), ("\U0010ffff\U0010ffff",)))
@example((("\U0010ffff",), ("\U0010ffff\x00",)))
@example((("a", ""), ("a", "", "")))
@example((("a", ""), ("a", "\x00")))
@example((("",), ("", "z")))
@example((("",), ("\x00",)))
def test_prefix_upper_bound_is_exclusive_and_exact(case):
    prefix, candidate = case
    lower = encode_storage_tuple(prefix)
    upper = encode_storage_tuple_prefix_upper_bound(prefix)
    encoded = encode_storage_tuple(candidate)
    starts_with_prefix = candidate[: len(prefix)] == prefix
    assert (lower <= encoded < upper) == starts_with_prefix
    assert StorageRange.prefix(prefix).contains(encoded) == starts_with_prefix
    assert lower < upper
    assert not StorageRange.prefix(prefix).contains(upper)


def test_prefix_upper_bound_uses_no_unicode_sentinel():
    # A value that begins with U+10FFFF can still have more bytes, so "prefix + U+10FFFF" is not a bound.
    prefix = ("env", "\U0010ffff")
    longer = encode_storage_tuple(("env", "\U0010ffff\U0010ffff"))
    child = encode_storage_tuple(("env", "\U0010ffff", "\U0010ffff" * 3))
    upper = encode_storage_tuple_prefix_upper_bound(prefix)
    assert child < upper
    assert longer >= upper
    rejected(encode_storage_tuple_prefix_upper_bound, ())


# ---------------------------------------------------------------------------------------------
# ISO dates

offsets = st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59).map(lambda minutes: timezone(timedelta(minutes=minutes)))
utc_datetimes = st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999), timezones=st.just(UTC))
# Away from the range edges so any offset still converts to a UTC year within 0001-9999.
offset_datetimes = st.datetimes(min_value=datetime(1, 1, 3), max_value=datetime(9999, 12, 29), timezones=offsets)


@PROPERTY
@given(st.one_of(utc_datetimes, offset_datetimes), st.one_of(utc_datetimes, offset_datetimes))
@example(datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC))
@example(datetime(2024, 1, 1, 0, 0, 0, 1, tzinfo=UTC), datetime(2024, 1, 1, tzinfo=UTC))
@example(datetime(2024, 1, 1, 1, tzinfo=timezone(timedelta(hours=2))), datetime(2024, 1, 1, tzinfo=UTC))
def test_iso_date_order_is_time_order_and_round_trips(left, right):
    encoded_left, encoded_right = encode_iso_date(left), encode_iso_date(right)
    assert (encoded_left < encoded_right) == (left < right)
    assert (encoded_left == encoded_right) == (left == right)
    decoded = decode_iso_date(encoded_left)
    assert decoded == left
    assert decoded.tzinfo is UTC
    assert encode_iso_date(decoded) == encoded_left


def test_iso_date_examples():
    assert encode_iso_date(datetime(2024, 2, 29, 23, 5, 6, 7, tzinfo=UTC)) == "2024-02-29T23:05:06.000007Z"
    assert encode_iso_date(datetime(1, 1, 1, tzinfo=UTC)) == "0001-01-01T00:00:00.000000Z"
    assert encode_iso_date(datetime(2024, 1, 1, 2, tzinfo=timezone(timedelta(hours=2)))) == "2024-01-01T00:00:00.000000Z"


@pytest.mark.parametrize(
    "value",
    [
        datetime(2024, 1, 1),  # naive
        "2024-01-01T00:00:00.000000Z",
        None,
        datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))),  # before year 1 in UTC
        datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5))),  # after year 9999 in UTC
    ],
)
def test_iso_date_encoding_rejects_naive_and_out_of_range_values(value):
    rejected(encode_iso_date, value)


@pytest.mark.parametrize(
    "encoded",
    [
        "2024-01-01T00:00:00Z",  # no microseconds
        "2024-01-01T00:00:00.000000",  # no Z
        "2024-01-01T00:00:00.000000+00:00",
        "2024-01-01 00:00:00.000000Z",
        "2024-1-01T00:00:00.0000000Z",  # same length, non-canonical fields
        "2024-01-01T0:00:00.0000000Z",
        "2024-13-01T00:00:00.000000Z",
        "2024-02-30T00:00:00.000000Z",
        "0000-01-01T00:00:00.000000Z",
        "٢٠٢٤-01-01T00:00:00.000000Z",  # non-ASCII digits
        "2024-01-01T00:00:00.00000５Z",
        "2024-01-01t00:00:00.000000Z",
        "2024-01-01T00:00:00.000000z",
        "",
        None,
    ],
)
def test_iso_date_decoding_rejects_non_canonical_text(encoded):
    rejected(decode_iso_date, encoded)


# ---------------------------------------------------------------------------------------------
# Unsigned 64-bit integers

u64 = st.one_of(
    st.integers(min_value=0, max_value=MAX_UNSIGNED_64),
    st.sampled_from([0, 1, 9, 10, 2**32, 2**53, 2**63, MAX_UNSIGNED_64 - 1, MAX_UNSIGNED_64]),
)


@PROPERTY
@given(u64, u64)
def test_sortable_unsigned_integer_order_is_numeric_order(left, right):
    encoded_left, encoded_right = encode_storage_unsigned_integer(left), encode_storage_unsigned_integer(right)
    assert len(encoded_left) == len(encoded_right) == 20
    assert encoded_left.isascii() and encoded_left.isdigit()
    assert (encoded_left < encoded_right) == (left < right)
    assert decode_storage_unsigned_integer(encoded_left) == left


@PROPERTY
@given(u64)
def test_decimal_form_round_trips(value):
    text = format_unsigned_64_decimal(value)
    assert text == str(value)
    assert parse_unsigned_64_decimal(text, positive=False) == value
    if value > 0:
        assert parse_unsigned_64_decimal(text) == value


def test_unsigned_integer_examples():
    assert encode_storage_unsigned_integer(0) == "00000000000000000000"
    assert encode_storage_unsigned_integer(MAX_UNSIGNED_64) == "18446744073709551615"
    assert parse_unsigned_64_decimal("18446744073709551615") == MAX_UNSIGNED_64
    assert parse_unsigned_64_decimal("0", positive=False) == 0


@pytest.mark.parametrize(
    "text",
    ["", "0", "01", "00", "+1", "-1", " 1", "1 ", "1\n", "1_000", "1.0", "1e3", "0x10", "١", "１", "²", "18446744073709551616", "99999999999999999999999", None, 1],
)
def test_positive_decimal_parse_rejects_non_canonical_text(text):
    error = rejected(parse_unsigned_64_decimal, text)
    assert error.code is ErrorCode.ADAPTER_CONTRACT_VIOLATION


@pytest.mark.parametrize("value", [-1, MAX_UNSIGNED_64 + 1, True, 1.0, "1", None])
def test_unsigned_integer_encoders_reject_values_out_of_range(value):
    rejected(format_unsigned_64_decimal, value)
    rejected(encode_storage_unsigned_integer, value)


@pytest.mark.parametrize(
    "encoded",
    ["", "1", "0000000000000000001", "000000000000000000001", "18446744073709551616", "99999999999999999999", "0000000000000000000a", "+0000000000000000001", "0000000000000000000١", None],
)
def test_sortable_unsigned_integer_decoding_rejects_malformed_text(encoded):
    rejected(decode_storage_unsigned_integer, encoded)


def test_the_key_range_of_entries_that_restate_their_key_holds_exactly_their_partition() -> None:
    from runlane.storage import StorageIndexEntry, StorageIndexName, encode_storage_unsigned_integer
    from runlane.storage.key_order import key_ordered_range, repeats_key
    from runlane.storage.tables import run_event_key

    def entry(run_id: str, sequence: int) -> StorageIndexEntry:
        return StorageIndexEntry(
            StorageIndexName.RUN_EVENTS_BY_RUN, ("env", run_id), (encode_storage_unsigned_integer(sequence),)
        )

    found = key_ordered_range(StorageIndexName.RUN_EVENTS_BY_RUN, entry("r", 1).encoded_partition)
    assert found is not None
    for sequence in (1, 2, 10**12):
        key = run_event_key("env", "r", sequence).encoded
        restating = entry("r", sequence)
        assert repeats_key(restating.name.value, restating.encoded_partition, restating.encoded_sort, key)
        assert key == found.prefix + restating.encoded_sort and key[found.start - 1 :] == restating.encoded_sort
        assert found.prefix <= key < found.upper
    # Runs whose id extends "r", or sorts right after it, lie outside the range.
    for neighbour in ("r0", "r1", "r/", "s", "q"):
        key = run_event_key("env", neighbour, 1).encoded
        assert not found.prefix <= key < found.upper, neighbour
    assert key_ordered_range(StorageIndexName.RUNS_RUNNABLE, entry("r", 1).encoded_partition) is None
