"""The write path's direct encodings equal the model-based ones they replace, byte for byte.

Core writes run documents, history rows and observation records from the models' field values and
lets ``orjson`` write datetimes and enum members; the in-memory driver keeps remembered runs in a
compact form, stores index partitions and projection groups as values folded on demand, and reads
every table as of a snapshot while other threads commit. Each is checked here against the plain
construction over every model shape ``test_model_json`` builds.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from test_model_json import ENV, all_events, all_runs

from runlane.core.observations import event_observation_documents, event_observation_values
from runlane.core.store import _model_document, _value_document
from runlane.model_json import (
    run_event_record_document_value,
    run_event_record_json,
    run_record_document_value,
    run_record_json,
)
from runlane.models import Environment, RunEventRecord, RunRecord
from runlane.storage import (
    NewStorageRecord,
    StorageCandidateMode,
    StorageDocument,
    StorageIndexEntry,
    StorageIndexName,
    StorageQuery,
    StorageRange,
    StorageRecordKey,
    StorageStreamName,
    encode_iso_date,
    encode_storage_append_value,
    encode_storage_tuple,
    materialize_storage_append,
    storage_stream_layouts,
)
from runlane.storage.attempt import StagedWrite, WrittenDocuments, page_index_rows
from runlane.storage.operator_sql import remember_run_row
from runlane.storage.streams import storage_append_rows, storage_append_templates
from runlane.storage.tables import (
    RunChildCounts,
    compact_decoded,
    decode_run_document,
    peek_run_document,
    remember_run_document,
)
from runlane.storage.types import StorageAppendCommand
from runlane.vocabulary import RunStatus
from runlane_local import LocalStorageStore, local_storage_driver
from runlane_local import memory

# ---------------------------------------------------------------------------------------------
# Documents written from field values


def test_run_documents_written_from_values_equal_the_json_dumps() -> None:
    for run in all_runs():
        counts = {"events": 3, "outbox": 0, "steps": 1, "links": 0}
        expected_value = {"run": run_record_json(run), "children": counts}
        direct = _value_document({"run": run_record_document_value(run), "children": counts}, lambda: expected_value)
        expected = _model_document(expected_value)
        assert (direct.text, direct.byte_size) == (expected.text, expected.byte_size)


def test_event_documents_written_from_values_equal_the_json_dumps() -> None:
    for sequence, event in enumerate(all_events(), start=1):
        direct = _value_document(
            run_event_record_document_value("evt_1", sequence, event),
            run_event_record_json,
            "evt_1",
            sequence,
            event,
        )
        expected = _model_document(run_event_record_json("evt_1", sequence, event))
        assert (direct.text, direct.byte_size) == (expected.text, expected.byte_size)


def test_a_value_orjson_cannot_write_falls_back_to_the_json_dumps() -> None:
    run = all_runs()[0].model_copy(update={"payload": {"big": 2**70}})
    counts = {"events": 1}
    direct = _value_document(
        {"run": run_record_document_value(run), "children": counts},
        lambda: {"run": run_record_json(run), "children": counts},
    )
    assert direct.text == _model_document({"run": run_record_json(run), "children": counts}).text
    assert str(2**70) in direct.text


def test_storage_dates_without_a_fraction_keep_six_digits() -> None:
    for value in (
        datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
        datetime(2030, 1, 2, 3, 4, 5, 7, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(2030, 1, 2, 8, 4, 5, tzinfo=timezone(timedelta(hours=5))),
    ):
        expected = value.astimezone(UTC).isoformat(timespec="microseconds")[:-6] + "Z"
        assert encode_iso_date(value) == expected


# ---------------------------------------------------------------------------------------------
# Observation records


def _observed_pairs():
    environments = [ENV, Environment(name='prød "x" \\ \n\t')]
    runs = all_runs()[:8]
    for environment in environments:
        for event in all_events():
            event = event.model_copy(update={"environment": environment})
            for run in runs:
                for task_id, queue in (("task.x", "q"), ('tâsk"1', "qüeue\\")):
                    projected = run.model_copy(
                        update={"id": event.run_id, "environment": environment, "task_id": task_id, "queue": queue}
                    )
                    yield projected, event


def test_observation_documents_equal_the_encoded_observation_values() -> None:
    checked = 0
    for run, event in _observed_pairs():
        for event_id in ("evt_" + "ab" * 16, 'évt "odd"'):
            records = [
                RunEventRecord.model_construct(id=event_id, sequence=7, event=event),
                RunEventRecord.model_construct(id=event_id + "2", sequence=8, event=event),
            ]
            direct = event_observation_documents(run, records)
            expected = [encode_storage_append_value(value, checked=True) for value in event_observation_values(run, records)]
            assert [(d.text, d.byte_size) for d in direct] == [(d.text, d.byte_size) for d in expected]
            assert [d.decoded.last_key for d in direct] == [d.decoded.last_key for d in expected]
            checked += 1
    assert checked > 1000


def test_observation_documents_materialize_like_the_stream_layout_writes_them() -> None:
    run, event = next(iter(_observed_pairs()))
    records = [RunEventRecord.model_construct(id=f"evt_{n}", sequence=n, event=event) for n in (1, 2)]
    documents = event_observation_documents(run, records)
    command = StorageAppendCommand(StorageStreamName.OBSERVATIONS, "tests", documents)
    layout = storage_stream_layouts[StorageStreamName.OBSERVATIONS]
    appended = materialize_storage_append(command, 41)
    for position, record, document in zip((41, 42), appended.records, documents):
        assert record == layout.stream_record("tests", position, document.value)
    prefix, partition, rows = storage_append_rows(command, 41)
    assert [prefix + row[1] for row in rows] == [record.key.encoded for record in appended.records]
    assert partition == encode_storage_tuple(("tests",))


@pytest.mark.parametrize(
    "values",
    [
        [{}],
        [{"a": 1}, {"environment": {"name": 'é "q"'}, "id": "obs_1", "n": [1, 2.5, None]}],
        [{"source_kind": "run_event", "observation": {"stream_position": "7"}}],
        [{"a": 1}, {"z": 1}],  # "z" sorts after the position field: that value is rebuilt
    ],
)
def test_append_templates_rebuild_every_row_at_any_position(values: list[dict[str, Any]]) -> None:
    """``before + digits + after`` of each template is the text ``storage_append_rows`` writes at that
    position, and the size without the digits plus theirs is its byte size; a value whose text is
    rebuilt at each position has no template."""
    command = StorageAppendCommand(
        StorageStreamName.OBSERVATIONS, "tests", [encode_storage_append_value(value) for value in values]
    )
    templates = storage_append_templates(command)
    if any(key > "stream_position" for value in values for key in value):
        assert templates is None
        return
    assert templates is not None and len(templates) == len(values)
    for start in (1, 41, 10**19, 2**64 - 1 - len(values)):
        _, _, rows = storage_append_rows(command, start)
        materialized = materialize_storage_append(command, start).records
        for offset, ((before, after, size), row, record) in enumerate(zip(templates, rows, materialized, strict=True)):
            digits = str(start + offset)
            assert before + digits + after == row[2] == record.document.text
            assert size + len(digits) == row[3] == record.document.byte_size


# ---------------------------------------------------------------------------------------------
# The compact remembered run


def _remembered(run: RunRecord) -> StorageDocument:
    return remember_run_document(StorageDocument("{}", 2), run, RunChildCounts(events=3, steps=1))


def test_compact_runs_decode_into_equal_fresh_runs() -> None:
    runs = all_runs()
    runs += [RunRecord.model_construct(**dict(run)) for run in runs[:10]]  # other field sets
    for run in runs:
        compact = compact_decoded(_remembered(run).decoded)
        assert compact[0] == "run/compact"
        document = StorageDocument("{}", 2).remember_decoded(compact)
        decoded, children = decode_run_document(document)
        assert decoded == run
        assert decoded.model_fields_set == run.model_fields_set
        assert list(decoded.__dict__) == list(run.__dict__)
        assert decoded.model_dump(mode="json") == run.model_dump(mode="json")
        assert children == RunChildCounts(events=3, steps=1)
        for name in ("environment", "counters", "lease", "wait", "failure", "source"):
            ours, theirs = getattr(decoded, name), getattr(run, name)
            assert type(ours) is type(theirs)
            assert ours is None or ours.model_fields_set == theirs.model_fields_set
        again, _ = decode_run_document(document)
        for name in ("payload", "output", "meta", "trace_carrier"):
            value = getattr(run, name)
            if isinstance(value, (dict, list)):
                assert getattr(decoded, name) is not getattr(again, name)  # every decode is caller-owned
        peeked = peek_run_document(StorageDocument("{}", 2).remember_decoded(compact))
        assert peeked == run


def test_a_compact_run_with_flat_json_values_is_untracked_by_the_collector() -> None:
    run = next(run for run in all_runs() if run.lease is not None and run.failure is None)
    run = run.model_copy(update={"payload": {"n": 1, "s": "x"}, "meta": {"m": True}, "trace_carrier": {"t": "1"}})
    compact = compact_decoded(_remembered(run).decoded)
    holder = [compact]
    for _ in range(4):
        gc.collect()
    assert not gc.is_tracked(holder[0])
    assert decode_run_document(StorageDocument("{}", 2).remember_decoded(compact))[0] == run


def test_values_other_than_remembered_runs_are_kept_as_they_are() -> None:
    shape = encode_storage_append_value({"a": 1}).decoded
    assert compact_decoded(shape) is shape
    assert compact_decoded(None) is None


def test_documents_a_sql_driver_keeps_hold_compact_runs_and_no_commit_only_values() -> None:
    """``WrittenDocuments`` keeps the text a driver replaced, with a remembered run compacted (read back
    equal to the run) and nothing for a value only the commit needed (a terminal run's projection
    source); the document the caller committed keeps its full run."""
    finished = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
    active = next(run for run in all_runs() if run.status not in finished)
    active_key = StorageRecordKey("runs", "env", "active")
    active_document = StorageDocument.encode({"run": active.model_dump(mode="json")})
    remember_run_document(active_document, active, RunChildCounts(events=3))
    finished_key = StorageRecordKey("runs", "env", "finished")
    finished_document = remember_run_row(StorageDocument.encode({"run": {}}), active)
    plain_key = StorageRecordKey("things", "plain")
    plain_document = StorageDocument.encode({"v": 1})
    written = WrittenDocuments()
    written.remember(
        [
            StagedWrite(key, "1", NewStorageRecord(key, document, ()))  # replacements: what is kept
            for key, document in (
                (active_key, active_document),
                (finished_key, finished_document),
                (plain_key, plain_document),
            )
        ]
    )

    kept = written.recall(active_key.encoded, active_document.text)
    assert kept is not None and kept.text == active_document.text and kept.byte_size == active_document.byte_size
    assert kept.decoded[0] == "run/compact"
    assert decode_run_document(kept) == (active, RunChildCounts(events=3))
    assert active_document.decoded[0] == "run" and active_document.decoded[1] == active
    kept_finished = written.recall(finished_key.encoded, finished_document.text)
    assert kept_finished is not None and kept_finished.decoded is None
    assert written.recall(plain_key.encoded, plain_document.text) is plain_document


# ---------------------------------------------------------------------------------------------
# The in-memory driver's tables


def test_trusted_index_pages_equal_the_checked_decoding() -> None:
    rows = [(encode_storage_tuple((f"2030-{n:02d}", f"rün {n}")), encode_storage_tuple(("c", "ë", str(n)))) for n in range(7)]
    query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, ("env", "q"), limit=5)
    checked = page_index_rows(query, iter(rows), look_ahead=True)
    trusted = page_index_rows(query, iter(rows), look_ahead=True, trusted=True)
    assert trusted == checked


def _record(name: str, sort: str) -> NewStorageRecord:
    entry = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("env", "q"), (sort, name))
    return NewStorageRecord(StorageRecordKey("items", name), StorageDocument.encode({"sort": sort}), (entry,))


@pytest.mark.parametrize("fold_rows, fold_values", [(256, 36), (2, 6), (0, 4)])
async def test_index_partitions_folded_at_any_point_list_the_committed_rows(
    monkeypatch: pytest.MonkeyPatch, fold_rows: int, fold_values: int
) -> None:
    monkeypatch.setattr(memory, "_FOLD_ROWS", fold_rows)
    monkeypatch.setattr(memory, "_FOLD_VALUES", fold_values)
    driver = local_storage_driver()
    rng = random.Random(fold_rows)
    present: dict[str, str] = {}
    query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, ("env", "q"), StorageRange(), limit=100)
    for _ in range(120):
        names = rng.sample([f"n{n}" for n in range(30)], rng.randrange(1, 6))

        async def change(tx, names=names):
            found = await tx.get([StorageRecordKey("items", name) for name in names])
            for name, record in zip(names, found):
                if record is None:
                    tx.create(_record(name, f"{rng.randrange(50):03d}"))
                elif rng.random() < 0.5:
                    tx.delete(record)
                else:
                    tx.replace(record, _record(name, f"{rng.randrange(50):03d}"))
            return names

        await driver.with_transaction(change)
        found = await driver.get([StorageRecordKey("items", name) for name in names])
        for name, record in zip(names, found):
            if record is None:
                present.pop(name, None)
            else:
                present[name] = record.document.value["sort"]
        if rng.random() < 0.3:  # reads fold the partition at some states, not at others
            page = await driver.query(query)
            assert [item.key.parts[0] for item in page.items] == [
                name for _, name in sorted((sort, name) for name, sort in present.items())
            ]
    page = await driver.query(query)
    assert [(item.sort[0], item.key.parts[0]) for item in page.items] == sorted(
        (sort, name) for name, sort in present.items()
    )


def test_attempts_read_their_snapshot_while_other_threads_commit() -> None:
    store = LocalStorageStore()
    keys = [StorageRecordKey("pairs", f"k{n}") for n in range(3)]
    partition = ("env", "q")
    errors: list[object] = []

    def record(key: StorageRecordKey, n: int) -> NewStorageRecord:
        entry = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, partition, (f"{n:06d}", key.parts[0]))
        return NewStorageRecord(key, StorageDocument.encode({"n": n}), (entry,))

    async def seed() -> None:
        async def body(tx):
            await tx.get(keys)
            for key in keys:
                tx.create(record(key, 0))

        await local_storage_driver(store=store).with_transaction(body)

    asyncio.run(seed())

    def work(seed_value: int) -> None:
        async def main() -> None:
            rng = random.Random(seed_value)
            driver = local_storage_driver(store=store, max_transaction_attempts=10_000)
            query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, partition, limit=10)
            for _ in range(300):
                if rng.random() < 0.5:

                    async def bump(tx):
                        found = []
                        for key in keys:  # one read at a time: other threads commit in between
                            found += await tx.get([key])
                        values = {item.document.value["n"] for item in found}
                        if len(values) != 1:
                            errors.append(values)
                        for item in found:
                            tx.replace(item, record(item.key, max(values) + 1))

                    await driver.with_transaction(bump)
                else:

                    async def look(tx):
                        page = await tx.query_candidates(query, mode=StorageCandidateMode.ADVISORY)
                        found = await tx.get(keys)
                        values = {item.document.value["n"] for item in found}
                        sorts = {int(item.sort[0]) for item in page.items}
                        if len(values) != 1 or sorts != values or len(page.items) != len(keys):
                            errors.append((values, sorts))

                    await driver.with_transaction(look)

        asyncio.run(main())

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    versions = store._state.versions
    assert versions.live == {} and not versions.log and not any(versions.older)  # nothing kept once idle
