"""In-memory driver throughput for a typical read-2-write-5 transaction.

Each transaction point-reads two records (a run and an owner row), seals with ``now()``, replaces
both and creates three event-like rows, each record carrying two index entries: the shape of a core
lifecycle write. Prints transactions/second sequentially and with concurrent writers.

    .venv/bin/python benchmarks/storage_bench.py [--transactions N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

from runlane.storage import (
    NewStorageRecord,
    StorageDocument,
    StorageIndexEntry,
    StorageIndexName,
    StorageRecordKey,
    encode_iso_date,
)
from runlane_local import local_storage_driver

PAYLOAD = {"user_id": "user_123", "template": "welcome", "locale": "en"}


def _record(key: StorageRecordKey, value: dict, sort_at: str) -> NewStorageRecord:
    """Run-like rows sit in two environment-wide indexes; event-like rows in their run's partition."""
    if key.collection == "bench_events":
        run_id, position = key.parts[1], key.parts[2]
        entries = (
            StorageIndexEntry(StorageIndexName.RUN_EVENTS_BY_RUN, ("bench", run_id), (position,)),
            StorageIndexEntry(StorageIndexName.OBSERVATION_STREAM, ("bench", run_id), (sort_at, position)),
        )
    else:
        entries = (
            StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("bench", key.collection), (sort_at, key.parts[-1])),
            StorageIndexEntry(StorageIndexName.RUNS_TERMINAL_BY_FINISHED_AT, ("bench", key.collection), (sort_at, key.parts[-1])),
        )
    return NewStorageRecord(key, StorageDocument.encode(value), entries)


async def _seed(driver, count: int) -> None:
    for start in range(0, count, 40):
        async def seed(tx, start=start):
            now = encode_iso_date(await tx.now())
            for i in range(start, min(start + 40, count)):
                tx.create(_record(StorageRecordKey("bench_runs", "bench", f"run_{i}"), {"n": 0, **PAYLOAD}, now))
                tx.create(_record(StorageRecordKey("bench_owners", "bench", f"run_{i}"), {"n": 0}, now))
        await driver.with_transaction(seed)


async def _one(driver, i: int) -> None:
    run_key = StorageRecordKey("bench_runs", "bench", f"run_{i}")
    owner_key = StorageRecordKey("bench_owners", "bench", f"run_{i}")

    async def body(tx):
        run, owner = await tx.get([run_key, owner_key])
        now = encode_iso_date(await tx.now())
        n = run.document.value["n"] + 1
        tx.replace(run, _record(run_key, {"n": n, **PAYLOAD}, now))
        tx.replace(owner, _record(owner_key, {"n": n}, now))
        for event in range(3):
            tx.create(_record(StorageRecordKey("bench_events", "bench", f"run_{i}", f"{n:04d}_{event}"), {"type": "x", **PAYLOAD}, now))

    await driver.with_transaction(body)


async def _phase(transactions: int, runs: int, concurrency: int) -> float:
    """Transactions/second on a fresh driver, so both phases start from the same data set."""
    driver = local_storage_driver()
    await driver.start()
    try:
        await _seed(driver, runs)
        block = runs // concurrency
        per_writer = transactions // concurrency

        async def writer(w: int) -> None:  # each writer owns its own block of runs
            for j in range(per_writer):
                await _one(driver, w * block + j % block)

        started = time.perf_counter()
        await asyncio.gather(*(writer(w) for w in range(concurrency)))
        return per_writer * concurrency / (time.perf_counter() - started)
    finally:
        await driver.close()


async def run(transactions: int, concurrency: int) -> None:
    runs = max(transactions // 4, concurrency)
    sequential = await _phase(transactions, runs, 1)
    concurrent = await _phase(transactions, runs, concurrency)
    print(f"in-memory driver, read-2-write-5 transactions ({platform.python_implementation()} {platform.python_version()})")
    print(f"  sequential:            {sequential:10,.0f} transactions/s  ({transactions:,} transactions over {runs:,} runs)")
    print(f"  {concurrency:2d} concurrent writers: {concurrent:10,.0f} transactions/s  (disjoint keys)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(run(args.transactions, args.concurrency))


if __name__ == "__main__":
    main()
