"""The storage conformance suite can fail.

``MiniDriver`` is a deliberately small, correct in-memory driver (no append, no operator reads). It
passes the core suite and the exclusive-candidate suite, which also shows that the suite depends on
the contract only, not on the local driver. Each broken variant below changes one mechanism the
way a real driver might get it wrong, and the conformance tests that guard that mechanism must fail
against it. Wrappers around the local driver do the same for operator reads and ordered append.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from runlane_local import LocalStorageStore, local_storage_driver

from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error
from runlane.models import Environment, RunRecord, environment_key
from runlane.storage import (
    NewStorageRecord,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexRef,
    StorageLimits,
    StorageProfile,
    StorageQuery,
    StorageQueryPosition,
    StorageQueryResult,
    StorageRecord,
    StorageRecordKey,
    create_storage_limit_error,
    decode_storage_query_cursor,
    decode_storage_tuple,
    encode_storage_query_cursor,
    measure_storage_record,
)
from runlane.storage.cursor import decode_opaque_token
from runlane.storage.tables import run_key, try_decode_run_document
from runlane.testing import StorageDriverConformance
from runlane.vocabulary import SortDirection

Row = tuple[str, str]  # (encoded sort, encoded key)


def _contract(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.ADAPTER_CONTRACT_VIOLATION, message)


class MiniStore:
    def __init__(self) -> None:
        self.records: dict[str, StorageRecord] = {}
        self.version = 0
        self.holds: dict[str, object] = {}


class MiniTransaction:
    def __init__(self, driver: MiniDriver) -> None:
        self.driver = driver
        self.reads: dict[str, str | None] = {}
        self.writes: dict[str, tuple[StorageRecordKey, str | None, NewStorageRecord | None]] = {}
        self.touched: set[str] = set()
        self.bytes = 0
        self.held: list[str] = []
        self.sealed = False
        self.ended = False
        self.failure: RunlaneError | None = None
        self.frozen: datetime | None = None

    def _fail(self, error: RunlaneError) -> None:
        self.failure = self.failure or error
        raise error

    def _check_open(self) -> None:
        if self.ended and self.driver.ends_attempts:
            raise _contract("the attempt has ended")

    def _check_readable(self) -> None:
        self._check_open()
        if self.sealed and self.driver.seals_reads:
            self._fail(_contract("reads after now() or a mutation"))

    def _touch(self, encoded: str) -> None:
        self.touched.add(encoded)
        limit = self.driver.profile.limits.max_transaction_records
        if self.driver.enforces_limits and len(self.touched) > limit:
            self._fail(create_storage_limit_error("max_transaction_records", limit, len(self.touched)))

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        self._check_readable()
        keys = list(keys)
        self.driver.check_point_reads(len(keys))
        await asyncio.sleep(0)
        self._check_readable()
        found = []
        for key in keys:
            self._touch(key.encoded)
            record = self.driver.store.records.get(key.encoded)
            self.reads[key.encoded] = None if record is None else record.version
            found.append(record)
        return found

    async def query_candidates(
        self, query: StorageQuery, *, mode: StorageCandidateMode = StorageCandidateMode.ADVISORY
    ) -> StorageQueryResult:
        self._check_readable()
        self.driver.check_query(query)
        await asyncio.sleep(0)
        rows = self.driver.rows(query)
        if mode is not StorageCandidateMode.EXCLUSIVE:
            return self.driver.page(query, rows, look_ahead=True)
        free = [row for row in rows if self.driver.is_free(row[1], self)]
        result = self.driver.page(query, free, look_ahead=False)
        for item in result.items:
            self.driver.store.holds[item.key.encoded] = self
            self.held.append(item.key.encoded)
        return result

    async def now(self) -> datetime:
        self._check_open()
        if self.frozen is None or not self.driver.freezes_now:
            self.frozen = self.driver.clock()
        self.sealed = True
        return self.frozen

    def create(self, record: NewStorageRecord) -> None:
        self._check_open()
        if self.reads.get(record.key.encoded) is not None:
            self._fail(_contract("create() of a key read as present"))
        self._stage(record.key, None, record)

    def replace(self, current: StorageRecord, record: NewStorageRecord) -> None:
        self._check_open()
        self._check_read(current)
        if current.key != record.key and self.driver.checks_mutations:
            self._fail(_contract("replace() cannot change the key"))
        self._stage(record.key, current.version, record)

    def delete(self, current: StorageRecord) -> None:
        self._check_open()
        self._check_read(current)
        self._stage(current.key, current.version, None)

    def append(self, command: Any) -> None:
        raise RunlaneError(ErrorCode.CAPABILITY_UNSUPPORTED, "MiniDriver has no ordered append")

    def _check_read(self, current: StorageRecord) -> None:
        if self.reads.get(current.key.encoded, "unread") != current.version and self.driver.checks_mutations:
            self._fail(_contract("replace()/delete() of a record not read as this version"))

    def _stage(self, key: StorageRecordKey, expected: str | None, record: NewStorageRecord | None) -> None:
        encoded = key.encoded
        if encoded in self.writes and self.driver.checks_mutations:
            self._fail(_contract("a key is mutated twice"))
        limits = self.driver.profile.limits
        size = 0 if record is None else measure_storage_record(record)
        if self.driver.enforces_limits:
            if size > limits.max_record_bytes:
                self._fail(create_storage_limit_error("max_record_bytes", limits.max_record_bytes, size))
            if self.bytes + size > limits.max_transaction_bytes:
                self._fail(
                    create_storage_limit_error("max_transaction_bytes", limits.max_transaction_bytes, self.bytes + size)
                )
        self._touch(encoded)
        self.bytes += size
        self.writes[encoded] = (key, expected, record)
        self.sealed = True
        self.driver.on_stage(key, record)

    def end(self) -> None:
        self.ended = True
        for encoded in self.held:
            if self.driver.store.holds.get(encoded) is self:
                del self.driver.store.holds[encoded]


class MiniDriver:
    """A small optimistic driver: live reads recorded with their versions, validated at commit."""

    name = "mini"
    seals_reads = True
    freezes_now = True
    enforces_limits = True
    checks_mutations = True
    ends_attempts = True

    def __init__(self, store: MiniStore | None = None, *, max_attempts: int = 16) -> None:
        self.store = store or MiniStore()
        self.max_attempts = max_attempts
        self.profile = StorageProfile(
            durability=StorageDurability.PROCESS,
            clock_authority=StorageClockAuthority.CLIENT,
            index_consistency=StorageIndexConsistency.STRONG,
            limits=StorageLimits(
                max_point_reads=20,
                max_query_results=20,
                max_record_bytes=4096,
                max_transaction_records=20,
                max_transaction_bytes=16384,
            ),
            exclusive_candidates=True,
        )

    # -- hooks the broken variants override -----------------------------------------------------

    def clock(self) -> datetime:
        return datetime.now(UTC)

    def validate(self, tx: MiniTransaction) -> bool:
        reads_hold = all(self._version(key) == version for key, version in tx.reads.items())
        writes_hold = all(self._version(key) == expected for key, (_, expected, _) in tx.writes.items())
        return reads_hold and writes_hold

    def order(self, rows: list[Row], query: StorageQuery) -> list[Row]:
        return sorted(rows, reverse=query.direction is SortDirection.DESC)

    def is_free(self, encoded: str, tx: MiniTransaction) -> bool:
        return self.store.holds.get(encoded, tx) is tx

    def on_stage(self, key: StorageRecordKey, record: NewStorageRecord | None) -> None:
        """Called for every staged mutation; the correct driver defers everything to the commit."""

    def stored_document(self, document: StorageDocument) -> StorageDocument:
        return document

    def index_rows(self, query: StorageQuery) -> list[Row]:
        return [
            (entry.encoded_sort, encoded)
            for encoded, record in self.store.records.items()
            for entry in record.indexes
            if entry.name is query.index and entry.encoded_partition == query.encoded_partition
        ]

    def cursor_position(self, query: StorageQuery) -> StorageQueryPosition | None:
        return decode_storage_query_cursor(query)

    # -- mechanics -------------------------------------------------------------------------------

    def _version(self, encoded: str) -> str | None:
        record = self.store.records.get(encoded)
        return None if record is None else record.version

    def check_point_reads(self, count: int) -> None:
        limit = self.profile.limits.max_point_reads
        if self.enforces_limits and count > limit:
            raise create_storage_limit_error("max_point_reads", limit, count)

    def check_query(self, query: StorageQuery) -> None:
        limit = self.profile.limits.max_query_results
        if self.enforces_limits and query.limit > limit:
            raise create_storage_limit_error("max_query_results", limit, query.limit)

    def rows(self, query: StorageQuery) -> list[Row]:
        rows = [row for row in self.index_rows(query) if query.range.contains(row[0])]
        rows = self.order(rows, query)
        after = self.cursor_position(query)
        if after is not None:
            position = (after.sort, after.key)
            descending = query.direction is SortDirection.DESC
            rows = [row for row in rows if (row < position if descending else row > position)]
        return rows

    def page(self, query: StorageQuery, rows: list[Row], *, look_ahead: bool) -> StorageQueryResult:
        page = rows[: query.limit]
        more = len(rows) > query.limit if look_ahead else len(page) == query.limit
        items = tuple(StorageIndexRef(StorageRecordKey.decode(key), decode_storage_tuple(sort)) for sort, key in page)
        cursor = encode_storage_query_cursor(query, StorageQueryPosition(*page[-1])) if more and page else None
        return StorageQueryResult(items, cursor)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        keys = list(keys)
        self.check_point_reads(len(keys))
        await asyncio.sleep(0)
        return [self.store.records.get(key.encoded) for key in keys]

    async def query(self, query: StorageQuery) -> StorageQueryResult:
        self.check_query(query)
        await asyncio.sleep(0)
        return self.page(query, self.rows(query), look_ahead=True)

    async def with_transaction(self, callback: Callable[[Any], Awaitable[Any]]) -> Any:
        for _ in range(self.max_attempts):
            tx = MiniTransaction(self)
            try:
                result = await callback(tx)
                if tx.failure is not None:
                    raise tx.failure
                committed = self._commit(tx)
            finally:
                tx.end()
            if committed:
                return result
            await asyncio.sleep(0)
        raise create_storage_conflict_error(StorageConflictKind.TRANSACTION)

    def _commit(self, tx: MiniTransaction) -> bool:
        if not self.validate(tx):
            return False
        for encoded, (key, _, record) in tx.writes.items():
            if record is None:
                self.store.records.pop(encoded, None)
                continue
            self.store.version += 1
            document = self.stored_document(record.document)
            self.store.records[encoded] = StorageRecord(key, str(self.store.version), document, record.indexes)
        return True


# ---------------------------------------------------------------------------------------------
# Broken variants


class LastWriterWinsDriver(MiniDriver):
    """Never validates: every attempt commits over whatever another writer did."""

    def validate(self, tx: MiniTransaction) -> bool:
        return True


class WriteSetOnlyDriver(MiniDriver):
    """Checks only the versions of written keys (snapshot isolation): absent and read-only
    dependencies go unprotected."""

    def validate(self, tx: MiniTransaction) -> bool:
        return all(self._version(key) == expected for key, (_, expected, _) in tx.writes.items())


class NoReplayDriver(MiniDriver):
    """Detects a conflict but fails the transaction at once instead of replaying the attempt."""

    def _commit(self, tx: MiniTransaction) -> bool:
        if not super()._commit(tx):
            raise create_storage_conflict_error(StorageConflictKind.TRANSACTION)
        return True


class AdvisoryExclusiveDriver(MiniDriver):
    """Advertises exclusive candidates but never skips held records."""

    def is_free(self, encoded: str, tx: MiniTransaction) -> bool:
        return True


class AscendingOnlyDriver(MiniDriver):
    """Ignores the query direction."""

    def order(self, rows: list[Row], query: StorageQuery) -> list[Row]:
        return sorted(rows)


class SortOnlyOrderDriver(MiniDriver):
    """Orders by sort value only, so ties come out in insertion order instead of key order."""

    def order(self, rows: list[Row], query: StorageQuery) -> list[Row]:
        return sorted(rows, key=lambda row: row[0], reverse=query.direction is SortDirection.DESC)


class WriteThroughDriver(MiniDriver):
    """Writes every staged mutation immediately, so nothing can be rolled back."""

    def on_stage(self, key: StorageRecordKey, record: NewStorageRecord | None) -> None:
        if record is None:
            self.store.records.pop(key.encoded, None)
        else:
            self.store.version += 1
            self.store.records[key.encoded] = StorageRecord(
                key, str(self.store.version), record.document, record.indexes
            )

    def validate(self, tx: MiniTransaction) -> bool:
        return True


class LiveClockDriver(MiniDriver):
    """Samples the clock on every now() call instead of freezing one time per attempt."""

    freezes_now = False


class StuckClockDriver(MiniDriver):
    """Reads one fixed time, as a driver caching a database timestamp would."""

    def clock(self) -> datetime:
        return datetime(2020, 1, 1, tzinfo=UTC)


class UnsealedReadsDriver(MiniDriver):
    """Keeps accepting reads after now() and after mutations."""

    seals_reads = False


class UnlimitedDriver(MiniDriver):
    """Advertises limits but enforces none of them."""

    enforces_limits = False


class _CachedDocument(StorageDocument):
    """A document that caches its parsed value and hands out that same dict on every access."""

    __slots__ = ("_cached",)

    def __init__(self, text: str, byte_size: int) -> None:
        super().__init__(text, byte_size)
        self._cached = json.loads(text)["value"]

    @property
    def value(self) -> dict[str, Any]:
        return self._cached


class SharedValueDriver(MiniDriver):
    """Returns documents whose value is one shared, mutable dict."""

    def stored_document(self, document: StorageDocument) -> StorageDocument:
        return _CachedDocument(document.text, document.byte_size)


class StaleIndexDriver(MiniDriver):
    """Adds the new index rows of a replaced or deleted record but never removes the old ones."""

    def __init__(self, store: MiniStore | None = None) -> None:
        super().__init__(store)
        self.stale: list[tuple[Any, str]] = []

    def _commit(self, tx: MiniTransaction) -> bool:
        previous = {encoded: self.store.records.get(encoded) for encoded in tx.writes}
        if not super()._commit(tx):
            return False
        for encoded, record in previous.items():
            if record is not None:
                self.stale.extend((entry, encoded) for entry in record.indexes)
        return True

    def index_rows(self, query: StorageQuery) -> list[Row]:
        stale = [
            (entry.encoded_sort, encoded)
            for entry, encoded in self.stale
            if entry.name is query.index and entry.encoded_partition == query.encoded_partition
        ]
        return sorted(set(super().index_rows(query) + stale))


class ScopeBlindCursorDriver(MiniDriver):
    """Reads the position out of any cursor without checking that it belongs to this query."""

    def cursor_position(self, query: StorageQuery) -> StorageQueryPosition | None:
        if query.cursor is None:
            return None
        payload = decode_opaque_token(query.cursor)
        if not isinstance(payload, dict) or not isinstance(payload.get("sort"), str):
            raise RunlaneError(ErrorCode.VALIDATION_FAILED, "malformed cursor")
        return StorageQueryPosition(payload["sort"], payload["key"])


class UncheckedMutationDriver(MiniDriver):
    """Trusts replace()/delete() arguments: no read check, no key check, no double-mutation check."""

    checks_mutations = False


class ReusableAttemptDriver(MiniDriver):
    """Leaves the transaction object usable after the attempt ended."""

    ends_attempts = False


# ---------------------------------------------------------------------------------------------
# Broken wrappers around the local driver (optional parts)


class _LocalWrapper:
    def __init__(self, store: LocalStorageStore) -> None:
        self.inner = local_storage_driver(store=store)
        self.name = self.inner.name
        self.profile = self.inner.profile

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TombstoneBlindDriver(_LocalWrapper):
    """get_run() decodes the raw run record and forgets to check for a tombstone."""

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None:
        [record] = await self.inner.get([run_key(environment_key(environment), run_id)])
        return None if record is None else try_decode_run_document(record.document)


class CachedRunDriver(_LocalWrapper):
    """Caches get_run() results and hands out the same objects."""

    def __init__(self, store: LocalStorageStore) -> None:
        super().__init__(store)
        self.cache: dict[tuple[str, str], RunRecord | None] = {}

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None:
        key = (environment.name, run_id)
        if key not in self.cache:
            self.cache[key] = await self.inner.get_run(environment, run_id)
        return self.cache[key]


class _DeferredAppends:
    def __init__(self, tx: Any) -> None:
        self.tx = tx
        self.commands: list[Any] = []

    def append(self, command: Any) -> None:
        self.commands.append(command)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tx, name)


class SeparateAppendCommitDriver(_LocalWrapper):
    """Commits each attempt's appends in a transaction of their own, outside the attempt's atomic
    boundary: rolled-back and replayed attempts still consume positions."""

    async def with_transaction(self, callback: Callable[[Any], Awaitable[Any]]) -> Any:
        async def attempt(tx: Any) -> Any:
            proxy = _DeferredAppends(tx)
            try:
                return await callback(proxy)
            finally:
                for command in proxy.commands:

                    async def append(inner: Any, command: Any = command) -> None:
                        inner.append(command)

                    await self.inner.with_transaction(append)

        return await self.inner.with_transaction(attempt)


# ---------------------------------------------------------------------------------------------
# Running suite methods directly


class MiniSuite(StorageDriverConformance):
    """The suite as a driver package would configure it (no ``Test`` prefix: not collected)."""

    supports_exclusive_candidates = True
    race_wait_seconds = 0.5
    timeout_seconds = 20.0

    @pytest.fixture
    def store(self) -> MiniStore:
        return MiniStore()

    @pytest.fixture
    def driver(self, store: MiniStore) -> MiniDriver:
        return MiniDriver(store)

    @pytest.fixture
    def peer_driver(self, store: MiniStore) -> MiniDriver:
        return MiniDriver(store)


class LocalSuite(StorageDriverConformance):
    supports_append = True
    supports_exclusive_candidates = True
    supports_operator_reads = True
    race_wait_seconds = 0.5
    timeout_seconds = 20.0


def run_suite_test(name: str, driver_class: type[Any]) -> None:
    run_method(LocalSuite() if issubclass(driver_class, _LocalWrapper) else MiniSuite(), name, driver_class)


def run_method(suite: StorageDriverConformance, name: str, driver_class: type[Any]) -> None:
    method = getattr(suite, name)
    store = LocalStorageStore() if issubclass(driver_class, _LocalWrapper) else MiniStore()
    arguments: dict[str, Any] = {"driver": driver_class(store)}
    if "peer_driver" in inspect.signature(method).parameters:
        arguments["peer_driver"] = driver_class(store)
    method(**arguments)


OPTIONAL_PREFIXES = (
    "test_append_",
    "test_operator_",
    "test_point_writers_",
    "test_concurrent_appenders_",
    "test_concurrent_mixed_writers_",
    "test_rolled_back_or_replayed_appends_",
)
CORE_AND_EXCLUSIVE_TESTS = sorted(
    name
    for name, member in inspect.getmembers(StorageDriverConformance, inspect.isfunction)
    if name.startswith("test_") and not name.startswith(OPTIONAL_PREFIXES)
)

CONFLICT_TESTS = [
    "test_present_read_conflict_replays_and_only_the_committed_result_escapes",
    "test_absent_read_dependency_is_validated_at_commit",
    "test_read_only_dependency_is_validated_at_commit",
    "test_blind_create_conflict_is_detected",
    "test_delete_and_recreate_between_read_and_commit_is_a_conflict",
    "test_concurrent_increments_are_never_lost",
    "test_concurrent_transfers_preserve_the_total",
    "test_racing_creators_of_one_absent_key_have_exactly_one_winner",
    "test_conflicts_are_detected_across_instances",
    "test_exhausted_conflict_budget_raises_a_retryable_storage_conflict",
    "test_blind_create_of_an_existing_key_commits_nothing",
]

EXPECTED_FAILURES: dict[type[Any], list[str]] = {
    LastWriterWinsDriver: CONFLICT_TESTS,
    WriteSetOnlyDriver: [
        "test_absent_read_dependency_is_validated_at_commit",
        "test_read_only_dependency_is_validated_at_commit",
    ],
    NoReplayDriver: [
        "test_present_read_conflict_replays_and_only_the_committed_result_escapes",
        "test_absent_read_dependency_is_validated_at_commit",
        "test_read_only_dependency_is_validated_at_commit",
        "test_blind_create_conflict_is_detected",
        "test_delete_and_recreate_between_read_and_commit_is_a_conflict",
        "test_conflicts_are_detected_across_instances",
    ],
    AdvisoryExclusiveDriver: [
        "test_exclusive_selections_are_disjoint_across_instances",
        "test_exclusive_holds_last_until_the_attempt_commits",
        "test_exclusive_holds_are_released_by_rollback_and_cancellation",
        "test_concurrent_exclusive_selections_are_pairwise_disjoint",
    ],
    AscendingOnlyDriver: [
        "test_query_orders_by_encoded_sort_in_both_directions",
        "test_query_range_bounds",
        "test_query_breaks_sort_ties_by_encoded_record_key",
        "test_query_pagination_yields_every_item_exactly_once",
        "test_query_candidates_return_the_committed_index_inside_an_attempt",
    ],
    SortOnlyOrderDriver: ["test_query_breaks_sort_ties_by_encoded_record_key"],
    WriteThroughDriver: [
        "test_a_raising_callback_rolls_back_every_staged_mutation",
        "test_cancelled_attempt_writes_nothing",
        "test_versions_are_positive_decimals_that_change_on_every_commit",
        "test_create_rejects_a_key_read_as_present",
        "test_record_size_limit",
        "test_transaction_record_limit",
    ],
    LiveClockDriver: ["test_now_is_frozen_within_an_attempt"],
    StuckClockDriver: ["test_now_moves_on_between_attempts_and_keeps_to_the_wall_clock"],
    UnsealedReadsDriver: ["test_reads_are_rejected_after_now", "test_reads_are_rejected_after_the_first_mutation"],
    UnlimitedDriver: [
        "test_point_read_limit",
        "test_query_limit",
        "test_record_size_limit",
        "test_transaction_record_limit",
        "test_transaction_byte_limit",
    ],
    SharedValueDriver: ["test_returned_records_are_defensive_copies"],
    StaleIndexDriver: [
        "test_replace_moves_index_rows_in_the_same_commit",
        "test_delete_removes_every_index_row",
    ],
    ScopeBlindCursorDriver: ["test_query_cursor_is_bound_to_its_scope"],
    UncheckedMutationDriver: [
        "test_replace_or_delete_of_an_unread_or_stale_record_is_rejected",
        "test_replace_cannot_change_the_key",
        "test_a_key_is_mutated_at_most_once_per_attempt",
    ],
    ReusableAttemptDriver: ["test_an_ended_attempt_cannot_be_used"],
    CachedRunDriver: ["test_operator_results_are_defensive_copies"],
    TombstoneBlindDriver: ["test_operator_tombstone_hides_the_run_and_its_events_in_the_same_commit"],
    SeparateAppendCommitDriver: [
        "test_rolled_back_or_replayed_appends_consume_no_positions",
        "test_append_forbids_the_streams_head_and_records_in_the_same_attempt",
    ],
}


@pytest.mark.parametrize("name", CORE_AND_EXCLUSIVE_TESTS)
def test_the_small_reference_driver_passes(name: str) -> None:
    run_suite_test(name, MiniDriver)


@pytest.mark.parametrize(
    ("driver_class", "name"),
    [(driver_class, name) for driver_class, names in EXPECTED_FAILURES.items() for name in names],
    ids=lambda value: value.__name__ if isinstance(value, type) else value,
)
def test_a_broken_driver_fails_the_guarding_test(driver_class: type[Any], name: str) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        run_suite_test(name, driver_class)


def test_every_expected_failure_names_a_suite_test() -> None:
    names = {name for names in EXPECTED_FAILURES.values() for name in names}
    suite = {name for name in dir(StorageDriverConformance) if name.startswith("test_")}
    assert names <= suite, names - suite


def test_switching_on_exclusive_candidates_without_a_peer_driver_fails_the_profile_check() -> None:
    class NoPeer(StorageDriverConformance):  # no peer_driver fixture: the cross-instance tests would only skip
        supports_exclusive_candidates = True
        timeout_seconds = 20.0

    with pytest.raises(AssertionError, match="needs a `peer_driver` fixture"):
        NoPeer().test_profile_matches_the_enabled_suites(driver=MiniDriver(MiniStore()))
    MiniSuite().test_profile_matches_the_enabled_suites(driver=MiniDriver(MiniStore()))


def test_a_profile_advertising_an_optional_part_whose_suite_is_off_fails_the_profile_check() -> None:
    class AllOff(StorageDriverConformance):
        timeout_seconds = 20.0

    driver = MiniDriver(MiniStore())  # advertises exclusive candidates
    assert driver.profile.exclusive_candidates and not driver.profile.ordered_append
    with pytest.raises(AssertionError, match="switch on supports_exclusive_candidates"):
        AllOff().test_profile_matches_the_enabled_suites(driver=driver)
    driver.profile = dataclasses.replace(driver.profile, ordered_append=True)
    with pytest.raises(AssertionError, match="switch on supports_append"):
        MiniSuite().test_profile_matches_the_enabled_suites(driver=driver)


class BlockingDriver(MiniDriver):
    """Holds a thread lock of its store across each transaction: a second, concurrent transaction
    blocks the event loop they share."""

    async def with_transaction(self, callback: Any) -> Any:
        lock = self.store.__dict__.setdefault("lock", threading.Lock())
        lock.acquire()
        try:
            return await super().with_transaction(callback)
        finally:
            lock.release()


def test_a_driver_that_blocks_its_event_loop_fails_the_test_instead_of_hanging_it() -> None:
    class Quick(MiniSuite):
        timeout_seconds = 1.0

    with pytest.raises(AssertionError, match="holds its event loop"):
        run_method(Quick(), "test_present_read_conflict_replays_and_only_the_committed_result_escapes", BlockingDriver)


class SmallLimitsDriver(MiniDriver):
    """A correct driver whose limits are smaller than some tests' data."""

    def __init__(self, store: MiniStore | None = None) -> None:
        super().__init__(store)
        limits = dataclasses.replace(
            self.profile.limits, max_point_reads=3, max_transaction_records=4, max_query_results=10
        )
        self.profile = dataclasses.replace(self.profile, limits=limits)


@pytest.mark.parametrize("name", CORE_AND_EXCLUSIVE_TESTS)
def test_a_correct_driver_with_small_limits_passes(name: str) -> None:
    run_suite_test(name, SmallLimitsDriver)
