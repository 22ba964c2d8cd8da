"""Checks the two SQL drivers (SQLite and Postgres) share beyond the storage conformance suite; not a
test module itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runlane.storage import NewStorageRecord, StorageDriver, StorageRecordKey


async def check_replaced_documents_are_recognized(
    here: StorageDriver,
    elsewhere: StorageDriver,
    key: StorageRecordKey,
    record: Callable[[StorageRecordKey, dict[str, Any]], NewStorageRecord],
) -> None:
    """``here`` and ``elsewhere`` are started drivers over one store, ``key`` is absent and
    ``record(key, value)`` builds a record of ``key``.

    A record read back by the driver that replaced it is that very document (its decoded value is
    kept); one it only created is read as stored, and so is a newer text written by the other driver,
    never mistaken for the old one."""
    # Imported here: at module level it would load the suite before pytest rewrites its asserts.
    from runlane.testing.storage_conformance import _create

    async def replace(driver: StorageDriver, new: NewStorageRecord) -> None:
        async def body(tx: Any) -> None:
            (current,) = await tx.get([key])
            tx.replace(current, new)

        await driver.with_transaction(body)

    created = record(key, {"n": 1})
    await _create(here, created)
    (read,) = await here.get([key])
    assert read is not None and read.document == created.document and read.document is not created.document

    replaced = record(key, {"n": 2})
    await replace(here, replaced)
    (read,) = await here.get([key])
    assert read is not None and read.document is replaced.document and read.indexes == replaced.indexes

    await replace(elsewhere, record(key, {"n": 3}))
    (again,) = await here.get([key])
    assert again is not None and again.document.value == {"n": 3} and again.version != read.version


def edit_sqlite_document(path: Any, key: StorageRecordKey, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite one stored document of the SQLite file at ``path`` in place, as a bad migration or a manual
    edit would: ``change`` edits the document envelope (``{"schemaVersion": ..., "value": ...}``)."""
    import json
    import sqlite3

    connection = sqlite3.connect(path)
    try:
        (text,) = connection.execute("SELECT document FROM runlane_records WHERE key = ?", (key.encoded,)).fetchone()
        document = json.loads(text)
        change(document)
        text = json.dumps(document, separators=(",", ":"))
        connection.execute(
            "UPDATE runlane_records SET document = ?, byte_size = ? WHERE key = ?", (text, len(text), key.encoded)
        )
        connection.commit()
    finally:
        connection.close()
