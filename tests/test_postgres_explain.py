"""Query plans of the Postgres driver on a schema holding 50,000 runs.

A few varied runs are made through the public runtime in four queues (succeeded, failed, queued,
retrying, released, running under a lease, queued with a failed outbox row on a transport lane, and
succeeded with a waiter its process did not resume), then multiplied in SQL into 50,000 distinct
runs: fresh run and outbox ids everywhere, and every time in the index rows and both operator
projections shifted back by a different number of seconds (documents keep their template's times).
Observation stream records are not multiplied: no read below touches them.

The index queries explained are the ones core itself issues: a worker's runnable scan
(``execute_next``) and a maintenance pass (``tick``) run against the populated schema with
``query()`` recorded, and every recorded ``StorageQuery`` goes to ``PostgresStorageDriver.explain``,
which plans the statement ``query()`` sends. Every read is planned with its parameter values and as
a generic prepared statement; each plan must read its index by name, with no sequential scan of a
Runlane table and no sort of rows the index already orders.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from runlane_postgres import apply_postgres_migrations, postgres_polling_lane, postgres_storage
from runlane_postgres.storage import PostgresStorageDriver, _PostgresAttempt

from runlane import ErrorCode, Retry, RunlaneError, TaskContext, create_lane, create_runlane, queue, task
from runlane.core.lanes import LaneDelivery
from runlane.models import Environment, environment_key
from runlane.storage import StorageCandidateMode, StorageIndexName, StorageQuery, StorageQueryResult
from runlane.storage.operator import PaginationParams, RunEventFilter, RunFilter
from runlane.testing import ControlledClock, RecordingTransport
from runlane.vocabulary import LaneDeliveryMode, RunEventSortField, RunSortField, RunStatus, SortDirection

RUNS = 50_000
ENVIRONMENT = Environment(name="default")

_QUEUES = [queue("emails", default=True), queue("reports"), queue("billing"), queue("webhooks")]
_gate: asyncio.Event  # made in the event loop of the population


@task("explain.echo")
async def _echo(payload: dict) -> dict:
    return {"echo": payload}


@task("explain.doomed")
async def _doomed(payload: dict) -> None:
    raise RunlaneError(ErrorCode.TASK_FAILED, "rejected", retryable=False)


@task("explain.flaky", retry=Retry(max_attempts=5, backoff="30s"))
async def _flaky(payload: dict) -> None:
    raise RunlaneError(ErrorCode.TASK_FAILED, "provider down", retryable=True)


@task("explain.later")
async def _later(payload: dict, ctx: TaskContext) -> Any:
    return ctx.release("5m", reason="not yet")


@task("explain.busy")
async def _busy(payload: dict) -> None:
    await _gate.wait()


@task("explain.awaiting")
async def _awaiting(payload: dict, ctx: TaskContext) -> Any:
    return ctx.wait_for_run(payload["source"])


_TASKS = [_echo, _doomed, _flaky, _later, _busy, _awaiting]

# Share of the 50,000 runs made from each kind of template run (one template per queue and kind). A
# "stranded" run succeeded while a run waited for it, and its process did not get to resume the waiter.
_MIX = {
    "succeeded": 60,
    "failed": 6,
    "queued": 14,
    "retrying": 5,
    "released": 4,
    "running": 4,
    "outbox": 5,
    "stranded": 2,
}

# Index names whose sort does not start with a time (a run's events and steps); every other one does.
_UNTIMED_INDEXES = [StorageIndexName.RUN_EVENTS_BY_RUN.value, StorageIndexName.RUN_STEPS_BY_RUN.value]

_BIG_TABLES = frozenset(
    {"runlane_records", "runlane_index_rows", "runlane_operator_runs", "runlane_operator_events"}
)
_INDEX_NODES = frozenset({"Index Scan", "Index Only Scan", "Bitmap Index Scan"})

# The scans core repeats all the time: what workers poll, delivery recovery and the outbox claim.
_SCANS = (StorageIndexName.RUNS_RUNNABLE, StorageIndexName.RUNS_NEEDING_DELIVERY, StorageIndexName.OUTBOX_DUE)


@dataclass
class Dataset:
    url: str
    schema: str
    run_id: str  # one multiplied run (succeeded, five events)
    queries: dict[str, list[StorageQuery]]  # index name -> what core asked once the runs were in
    idle: dict[str, list[StorageQuery]]  # the same a day earlier, when nothing is due
    exclusive: frozenset[str]  # index names core queried as exclusive candidates
    counts: dict[str, int]  # rows per Runlane table


# ---------------------------------------------------------------------------------------------
# Population


async def _templates(
    polling: Any, publishing: Any, transport: RecordingTransport, clock: ControlledClock, busy: list[asyncio.Task[Any]]
) -> dict[str, str]:
    """Template runs through the public runtime (run id -> kind); attempts left running go to ``busy``."""
    kinds: dict[str, str] = {}
    for name in (definition.name for definition in _QUEUES):
        # One due run at a time per queue, so each execute_next takes the run just triggered.
        running = (await polling.trigger(_busy, {}, queue=name)).run.id
        kinds[running] = "running"
        busy.append(asyncio.create_task(polling.execute_next(queues=[name])))
        for _ in range(500):
            run = await polling.runs.get(running)
            if run is not None and run.status is RunStatus.RUNNING:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the attempt of {running} did not start")
        for kind, definition in (("succeeded", _echo), ("failed", _doomed), ("retrying", _flaky), ("released", _later)):
            clock.advance("1s")
            run = (await polling.trigger(definition, {"kind": kind}, queue=name)).run
            executed = await polling.execute_next(queues=[name])
            assert executed is not None and executed.id == run.id, (kind, executed)
            assert executed.status.value == kind, (kind, executed)
            kinds[run.id] = kind
        clock.advance("1s")
        source = (await polling.trigger(_echo, {"kind": "stranded"}, queue=name, delay="1s")).run
        waiter = (await polling.trigger(_awaiting, {"source": source.id}, queue=name)).run
        assert (await polling.execute_next(queues=[name])).status is RunStatus.RELEASED
        kinds[waiter.id] = "released"  # for good: it waits for the stranded run
        clock.advance("1s")

        async def gone(source_run_id: str) -> None:
            return None  # the process went away before resuming the waiter: tick() is to do it

        polling._resume_waiters_riding_out = gone
        try:
            assert (await polling.execute_next(queues=[name])).id == source.id
        finally:
            del polling._resume_waiters_riding_out
        kinds[source.id] = "stranded"
        clock.advance("1s")
        kinds[(await polling.trigger(_echo, {"kind": "queued"}, queue=name)).run.id] = "queued"
        transport.fail_next(1)  # the wakeup stays in the outbox, due again after a backoff
        kinds[(await publishing.trigger(_echo, {"kind": "outbox"}, queue=name)).run.id] = "outbox"
    for run_id, kind in kinds.items():
        run = await polling.runs.get(run_id)
        expected = {"outbox": "queued", "stranded": "succeeded"}.get(kind, kind)
        assert run is not None and run.status.value == expected, (kind, run)
    return kinds


def _swap(column: str) -> str:
    """``column`` (a key, partition or sort) with the template's hex-encoded run and outbox ids
    replaced by the copy's."""
    return f"replace(replace({column}, c.hr, c.hr2), c.hm, c.hm2)"


def _swap_text(column: str) -> str:
    """``column`` (a document) with the template's run and outbox ids replaced by the copy's."""
    return f"replace(replace({column}, c.r, c.r2), c.m, c.m2)"


# Helpers of the population (session-local). Each parameter is used once, so the planner inlines them.
_HELPERS = """
CREATE FUNCTION pg_temp.rl_hex(value text) RETURNS text LANGUAGE sql IMMUTABLE
AS $$ SELECT encode(convert_to(value, 'UTF8'), 'hex') $$;
CREATE FUNCTION pg_temp.rl_shift(iso text, seconds integer) RETURNS text LANGUAGE sql IMMUTABLE
AS $$ SELECT to_char((iso::timestamptz - seconds * interval '1 second') AT TIME ZONE 'UTC',
                     'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') $$;
-- A timed sort starts with the 54 hex digits of an encoded date (27 ASCII characters).
CREATE FUNCTION pg_temp.rl_shift_sort(sort text, seconds integer) RETURNS text LANGUAGE sql IMMUTABLE
AS $$ SELECT pg_temp.rl_hex(pg_temp.rl_shift(convert_from(decode(left(sort, 54), 'hex'), 'UTF8'), seconds))
             || substr(sort, 55) $$;
"""

# Scratch tables: the template outbox rows, one row per copy (old and new ids, plain and hex, and
# its time shift in seconds), the template runs' records, and the copies' index rows. A copied
# record's own entry list ("name,partition,sort ...") is rebuilt from its copied rows when it has
# a timed entry; otherwise it is the template's list with the ids swapped.
_PREPARE = f"""
CREATE TEMP TABLE outbox AS
SELECT document::json -> 'value' ->> 'run_id' AS r, document::json -> 'value' ->> 'id' AS m
FROM {{s}}.runlane_records WHERE key LIKE pg_temp.rl_hex('outbox_messages') || '/%';

CREATE TEMP TABLE copies AS
SELECT t, r, r2, pg_temp.rl_hex(r) AS hr, pg_temp.rl_hex(r2) AS hr2, m, m2, pg_temp.rl_hex(m) AS hm,
       pg_temp.rl_hex(m2) AS hm2, g AS seconds
FROM (
    SELECT x.t, x.r, x.g, 'run_' || lpad(to_hex(x.g), 8, '0') || substr(x.r, 13) AS r2,
           coalesce(o.m, x.r) AS m,
           coalesce('obx_' || lpad(to_hex(x.g), 8, '0') || substr(o.m, 13),
                    'run_' || lpad(to_hex(x.g), 8, '0') || substr(x.r, 13)) AS m2
    FROM (
        SELECT templates.t, templates.r, (row_number() OVER (ORDER BY templates.t, n))::integer AS g
        FROM templates, generate_series(1, templates.copies) AS n
    ) AS x
    LEFT JOIN outbox AS o ON o.r = x.r
) AS y;

CREATE TEMP TABLE template_records AS
SELECT c.t, r.key, r.document::text AS document, r.byte_size, r.indexes,
       EXISTS (SELECT FROM {{s}}.runlane_index_rows AS x
               WHERE x.key = r.key AND x.index_name <> ALL({{untimed}})) AS timed
FROM (SELECT DISTINCT t, hr, hm FROM copies) AS c
JOIN {{s}}.runlane_records AS r ON strpos(r.key, c.hr) > 0 OR strpos(r.key, c.hm) > 0;

CREATE TEMP TABLE index_rows AS
SELECT x.index_name, {_swap("x.partition")} AS partition,
       CASE WHEN x.index_name = ANY({{untimed}}) THEN {_swap("x.sort")}
            ELSE {_swap("pg_temp.rl_shift_sort(x.sort, c.seconds)")} END AS sort,
       {_swap("x.key")} AS key, tr.timed
FROM copies AS c JOIN template_records AS tr ON tr.t = c.t
JOIN {{s}}.runlane_index_rows AS x ON x.key = tr.key;

CREATE TEMP TABLE entries AS
SELECT key, string_agg(index_name || ',' || partition || ',' || sort, ' ') AS indexes
FROM index_rows WHERE timed GROUP BY key;
"""

_LOAD = f"""
INSERT INTO {{s}}.runlane_index_rows (index_name, partition, sort, key)
SELECT index_name, partition, sort, key FROM index_rows;

CREATE INDEX ON entries (key);
ANALYZE entries;

INSERT INTO {{s}}.runlane_records (key, version, document, byte_size, indexes)
SELECT {_swap("tr.key")}, nextval({{sequence}}), {_swap_text("tr.document")}::json, tr.byte_size,
       CASE WHEN tr.timed THEN (SELECT e.indexes FROM entries AS e WHERE e.key = {_swap("tr.key")})
            ELSE {_swap("tr.indexes")} END
FROM copies AS c JOIN template_records AS tr ON tr.t = c.t;

INSERT INTO {{s}}.runlane_operator_runs
SELECT o.environment, c.r2, replace(o.record_key, c.hr, c.hr2), replace(o.tombstone_key, c.hr, c.hr2),
       o.status, o.task_id, o.queue, o.idempotency_key, o.singleton_key, o.source_run_id,
       pg_temp.rl_shift(o.created_at, c.seconds), pg_temp.rl_shift(o.updated_at, c.seconds),
       pg_temp.rl_shift(o.run_at, c.seconds), o.available_missing,
       CASE WHEN o.available_at = '' THEN '' ELSE pg_temp.rl_shift(o.available_at, c.seconds) END
FROM copies AS c JOIN {{s}}.runlane_operator_runs AS o ON o.run_id = c.r;

INSERT INTO {{s}}.runlane_operator_events
SELECT e.environment, c.r2, e.sequence, replace(e.record_key, c.hr, c.hr2), e.type,
       pg_temp.rl_shift(e.occurred_at, c.seconds)
FROM copies AS c JOIN {{s}}.runlane_operator_events AS e ON e.run_id = c.r;
"""


def _copies(kinds: dict[str, str]) -> dict[str, int]:
    """How many copies of each template run make ``RUNS`` runs in the proportions of ``_MIX``."""
    per_kind = {kind: sum(1 for value in kinds.values() if value == kind) for kind in _MIX}
    total = sum(_MIX.values())
    copies = {run_id: round(RUNS * _MIX[kind] / total / per_kind[kind]) - 1 for run_id, kind in kinds.items()}
    first = next(run_id for run_id, kind in kinds.items() if kind == "succeeded")
    copies[first] += RUNS - len(kinds) - sum(copies.values())
    return copies


def _multiply(url: str, schema: str, kinds: dict[str, str]) -> tuple[dict[str, int], str]:
    """Copy every template run (records, index rows, projection rows) until the schema holds ``RUNS``
    runs; returns the row count of each Runlane table and the id of one copied succeeded run.

    The Runlane tables are made UNLOGGED first, which spares the load its write-ahead log; the
    planner treats them exactly like logged tables.
    """
    s = sql.Identifier(schema)
    names = {
        "s": s,
        "sequence": sql.Literal(f'"{schema}".runlane_record_versions'),
        "untimed": sql.Literal(_UNTIMED_INDEXES),
    }
    tables = {name: sql.Identifier(name) for name in sorted(_BIG_TABLES)}
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        for table in tables.values():
            conn.execute(sql.SQL("ALTER TABLE {}.{} SET UNLOGGED").format(s, table))
        conn.execute("SET work_mem = '256MB'")
        conn.execute(_HELPERS)
        conn.execute("CREATE TEMP TABLE templates (t integer, r text, copies integer)")
        with conn.cursor().copy("COPY templates (t, r, copies) FROM STDIN") as copy:
            for number, (run_id, count) in enumerate(_copies(kinds).items()):
                copy.write_row((number, run_id, count))
        conn.execute(sql.SQL(_PREPARE).format(**names))  # type: ignore[arg-type]
        conn.execute(sql.SQL(_LOAD).format(**names))  # type: ignore[arg-type]
        counts = {}
        for name, table in tables.items():
            conn.execute(sql.SQL("VACUUM ANALYZE {}.{}").format(s, table))
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(s, table)).fetchone()
            counts[name] = row[0] if row else 0
        row = conn.execute(
            sql.SQL(
                "SELECT run_id FROM {}.runlane_operator_runs WHERE status = 'succeeded' "
                "ORDER BY created_at, run_id OFFSET 1000 LIMIT 1"
            ).format(s)
        ).fetchone()
    assert row is not None
    return counts, row[0]


async def _core_queries(polling: Any, publishing: Any, exclusive: set[str]) -> dict[str, list[StorageQuery]]:
    """The index queries a worker's poll and a maintenance pass issue, outside transactions and as
    exclusive candidates inside them (their index names go to ``exclusive``), recorded (answered empty)."""
    recorded: dict[str, list[StorageQuery]] = {}

    async def record(query: StorageQuery) -> StorageQueryResult:
        recorded.setdefault(query.index.value, []).append(query)
        return StorageQueryResult(items=())

    async def record_candidates(attempt: Any, query: StorageQuery, mode: StorageCandidateMode) -> StorageQueryResult:
        if mode is StorageCandidateMode.EXCLUSIVE:
            exclusive.add(query.index.value)
        return await record(query)

    original = _PostgresAttempt._candidates
    _PostgresAttempt._candidates = record_candidates  # type: ignore[method-assign]
    try:
        for runtime, action in ((polling, lambda: polling.execute_next()), (publishing, lambda: publishing.tick())):
            driver = runtime.lane.storage
            driver.query = record
            try:
                await action()
            finally:
                del driver.query
    finally:
        _PostgresAttempt._candidates = original  # type: ignore[method-assign]
    return recorded



async def _populate(url: str, schema: str) -> Dataset:
    await apply_postgres_migrations(url, schema)
    clock = ControlledClock()
    polling = create_runlane(
        lane=postgres_polling_lane(url, schema=schema, min_size=0), queues=_QUEUES, tasks=_TASKS, clock=clock
    )
    transport = RecordingTransport(clock=clock)
    lane = create_lane(
        storage=postgres_storage(url, schema=schema, min_size=0),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
        name="explain-transport",
    )
    publishing = create_runlane(lane=lane, queues=_QUEUES, tasks=_TASKS, clock=clock)
    global _gate
    _gate = asyncio.Event()
    busy: list[asyncio.Task[Any]] = []
    async with polling, publishing:
        try:
            kinds = await _templates(polling, publishing, transport, clock, busy)
            counts, run_id = await asyncio.to_thread(_multiply, url, schema, kinds)
            now = clock.now()
            exclusive: set[str] = set()
            queries = await _core_queries(polling, publishing, exclusive)
            clock.set(now - timedelta(days=1))  # an idle poll: nothing is due yet
            idle = await _core_queries(polling, publishing, exclusive)
            clock.set(now)
        finally:
            _gate.set()
            await asyncio.gather(*busy, return_exceptions=True)
    return Dataset(url, schema, run_id, queries, idle, frozenset(exclusive), counts)


# ---------------------------------------------------------------------------------------------
# Fixtures and plan helpers


@pytest.fixture(scope="module")
def dataset(postgres_url: str) -> Iterator[Dataset]:
    schema = f"runlane_explain_{uuid.uuid4().hex[:12]}"
    try:
        yield asyncio.run(_populate(postgres_url, schema))
    finally:
        with psycopg.connect(postgres_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextlib.asynccontextmanager
async def _driver(data: Dataset) -> AsyncIterator[PostgresStorageDriver]:
    driver = postgres_storage(data.url, schema=data.schema, min_size=0)
    await driver.start()
    try:
        yield driver
    finally:
        await driver.close()


def _nodes(node: dict) -> Iterator[dict]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def _describe(plan: dict) -> str:
    """The plan tree, one node a line: type, index, table and estimated rows."""
    lines = []

    def walk(node: dict, depth: int) -> None:
        index = f" using {node['Index Name']}" if "Index Name" in node else ""
        relation = f" on {node['Relation Name']}" if "Relation Name" in node else ""
        lines.append(f"{'  ' * depth}{node['Node Type']}{index}{relation} (rows={node.get('Plan Rows')})")
        for child in node.get("Plans", ()):
            walk(child, depth + 1)

    walk(plan["Plan"], 0)
    return "\n".join(lines)


def _index_nodes(plan: dict, index: str) -> list[dict]:
    """The nodes of ``plan`` that read ``index``."""
    nodes = _nodes(plan["Plan"])
    return [node for node in nodes if node["Node Type"] in _INDEX_NODES and node.get("Index Name") == index]


def assert_indexed(plan: dict, index: str, *, sorted_rows_of: str | None = None) -> None:
    """``index`` is read by an index node, no Runlane table is scanned sequentially, and nothing is
    sorted: the index gives the order. With ``sorted_rows_of``, a sort is allowed when every row it
    orders comes from an index scan whose condition fixes that column (one run's rows)."""
    nodes = list(_nodes(plan["Plan"]))
    shown = _describe(plan)
    assert _index_nodes(plan, index), f"{index} is not used:\n{shown}"
    scanned = [node for node in nodes if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in _BIG_TABLES]
    assert not scanned, f"a sequential scan of a Runlane table:\n{shown}"
    for node in nodes:
        if "Sort" not in node["Node Type"]:
            continue
        assert sorted_rows_of is not None, f"the index does not give the order:\n{shown}"
        sources = [
            child
            for child in _nodes(node)
            if child["Node Type"] in _INDEX_NODES and child.get("Relation Name") in _BIG_TABLES
            and child.get("Index Name") == index
        ]
        assert sources and all(f"{sorted_rows_of} = " in child.get("Index Cond", "") for child in sources), (
            f"a sort of more than one {sorted_rows_of}'s rows:\n{shown}"
        )


async def _plans(
    driver: PostgresStorageDriver,
    read: Any,
    pagination: PaginationParams | None = None,
    mode: StorageCandidateMode = StorageCandidateMode.ADVISORY,
) -> list[dict]:
    """The plan with the parameter values, then the generic plan of the prepared statement."""
    options: dict[str, Any] = {} if mode is StorageCandidateMode.ADVISORY else {"mode": mode}
    return [
        await driver.explain(read, pagination, **options),
        await driver.explain(read, pagination, generic=True, **options),
    ]


# ---------------------------------------------------------------------------------------------
# The data set and the diagnostic itself


async def test_the_schema_holds_50000_distinct_readable_runs(dataset: Dataset) -> None:
    counts = dataset.counts
    assert counts["runlane_operator_runs"] == RUNS
    assert counts["runlane_operator_events"] > 4 * RUNS
    assert counts["runlane_records"] > counts["runlane_operator_runs"] + counts["runlane_operator_events"]
    # Every run has index rows (runnable, recovery, terminal); its events' entries restate their keys: none.
    assert RUNS < counts["runlane_index_rows"] < counts["runlane_operator_events"]
    hundred = PaginationParams(limit=100)
    async with _driver(dataset) as driver:
        page = await driver.list_runs(RunFilter(environment=ENVIRONMENT), hundred)
        assert len({summary.id for summary in page.data}) == 100 and page.next_cursor is not None
        for status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RETRYING, RunStatus.RELEASED, RunStatus.FAILED):
            page = await driver.list_runs(RunFilter(environment=ENVIRONMENT, statuses=(status,)), hundred)
            assert len({summary.id for summary in page.data}) == 100, status
            assert {summary.status for summary in page.data} == {status}
        one_run = RunEventFilter(environment=ENVIRONMENT, run_id=dataset.run_id)
        events = await driver.list_run_events(one_run, PaginationParams())
        assert [record.event.run_id for record in events.data] == [dataset.run_id] * 5
        for index in _SCANS:
            for query in dataset.queries[index.value]:  # a backlog of due rows behind every scan
                assert len((await driver.query(query)).items) == query.limit, index
            for query in dataset.idle[index.value]:  # and nothing due a day earlier
                assert (await driver.query(query)).items == (), index


async def test_explain_plans_exactly_the_statement_each_read_sends(
    dataset: Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text the server received for a read (``pg_stat_activity`` of the driver's one connection,
    however the driver sends it) is the text ``explain`` plans, plain and prepared."""
    name = f"runlane_explain_{uuid.uuid4().hex[:8]}"
    url = f"{dataset.url}{'&' if '?' in dataset.url else '?'}application_name={name}"
    sent: list[str] = []
    execute = psycopg.AsyncConnection.execute

    async def recording(self: Any, query: Any, params: Any = None, **options: Any) -> Any:
        if isinstance(query, str):
            numbers = iter(range(1, 1000))
            sent.append(re.sub("%s", lambda _: f"${next(numbers)}", query) if params else query)
        return await execute(self, query, params, **options)

    def received() -> str:
        rows = monitor.execute("SELECT query FROM pg_stat_activity WHERE application_name = %s", (name,)).fetchall()
        ((text,),) = rows
        assert len(text.encode("utf-8")) < 1000, "pg_stat_activity may have cut the statement"
        return text

    queued = RunFilter(environment=ENVIRONMENT, statuses=(RunStatus.QUEUED,))
    one_run = RunEventFilter(environment=ENVIRONMENT, run_id=dataset.run_id)
    runnable = dataset.queries[StorageIndexName.RUNS_RUNNABLE.value][0]
    driver = postgres_storage(url, schema=dataset.schema, min_size=0, max_size=1)
    await driver.start()
    try:
        with psycopg.connect(dataset.url, autocommit=True, connect_timeout=10) as monitor:
            first = await driver.list_runs(queued, PaginationParams(limit=5))
            reads: list[tuple[Any, Any, PaginationParams | None]] = [
                (driver.query, runnable, None),
                (driver.list_runs, queued, PaginationParams(limit=5, cursor=first.next_cursor)),
                (driver.list_run_events, one_run, PaginationParams()),
            ]
            monkeypatch.setattr(psycopg.AsyncConnection, "execute", recording)
            for method, read, pagination in reads:
                await (method(read) if pagination is None else method(read, pagination))
                statement = received()
                sent.clear()
                plan = await driver.explain(read, pagination)
                assert sent == [f"EXPLAIN (FORMAT JSON) {statement}"] and "Plan" in plan
                assert received() == sent[0]
                sent.clear()
                await driver.explain(read, pagination, generic=True)
                assert f"PREPARE runlane_explain AS {statement}" in sent
            analyzed = await driver.explain(runnable, analyze=True)
            assert analyzed["Plan"]["Actual Rows"] == runnable.limit + 1 and "Execution Time" in analyzed
            with pytest.raises(RunlaneError):
                await driver.explain("SELECT 1")  # type: ignore[arg-type]
    finally:
        await driver.close()


# ---------------------------------------------------------------------------------------------
# What core asks


_PRIMARY_KEY = "runlane_index_rows_pkey"


async def _assert_core_scan(dataset: Dataset, index: StorageIndexName) -> None:
    """Every query of ``index`` a poll or a tick issued, due or idle, plain and prepared, reads the
    index rows' primary key in order and stops after the page (at most ``limit + 1`` rows)."""
    queries = dataset.queries[index.value] + dataset.idle[index.value]
    assert queries and all(query.index is index for query in queries)
    mode = StorageCandidateMode.EXCLUSIVE if index.value in dataset.exclusive else StorageCandidateMode.ADVISORY
    async with _driver(dataset) as driver:
        for query in queries:
            for plan in await _plans(driver, query, mode=mode):
                assert_indexed(plan, _PRIMARY_KEY)
                (node,) = _index_nodes(plan, _PRIMARY_KEY)
                assert "index_name = " in node["Index Cond"] and "sort < " in node["Index Cond"], node["Index Cond"]
            analyzed = await driver.explain(query, analyze=True, mode=mode)
            (node,) = _index_nodes(analyzed, _PRIMARY_KEY)
            assert node["Actual Rows"] <= query.limit + 1, _describe(analyzed)


async def test_the_runnable_scan_of_every_queue_reads_runs_runnable_in_index_order(dataset: Dataset) -> None:
    # A worker claims from an exclusive scan (runs other processes are claiming are skipped, not raced for).
    assert StorageIndexName.RUNS_RUNNABLE.value in dataset.exclusive
    await _assert_core_scan(dataset, StorageIndexName.RUNS_RUNNABLE)
    assert len(dataset.queries[StorageIndexName.RUNS_RUNNABLE.value]) == len(_QUEUES)


async def test_delivery_recovery_reads_runs_needing_delivery_in_index_order(dataset: Dataset) -> None:
    await _assert_core_scan(dataset, StorageIndexName.RUNS_NEEDING_DELIVERY)


async def test_the_outbox_claim_reads_outbox_due_in_index_order(dataset: Dataset) -> None:
    await _assert_core_scan(dataset, StorageIndexName.OUTBOX_DUE)


async def test_every_other_index_query_of_a_poll_and_a_tick_reads_in_index_order(dataset: Dataset) -> None:
    others = set(dataset.queries) - {index.value for index in _SCANS}
    assert StorageIndexName.RUNS_NEEDING_TIMEOUT_FINALIZATION.value in others
    for name in sorted(others):
        await _assert_core_scan(dataset, StorageIndexName(name))


async def test_reads_of_entries_restating_their_key_take_one_page_from_each_primary_key(dataset: Dataset) -> None:
    """Events by run have no index rows (runlane.storage.key_order): a page merges the index rows of
    other entries with a key range of the records, each read in key order and cut to the page."""
    env = environment_key(ENVIRONMENT)
    events = StorageQuery(StorageIndexName.RUN_EVENTS_BY_RUN, (env, dataset.run_id), limit=2)
    queries = [events, StorageQuery(events.index, events.partition, direction=SortDirection.DESC, limit=2)]
    queries.append(StorageQuery(StorageIndexName.OBSERVATION_STREAM, (env,), limit=50))
    async with _driver(dataset) as driver:
        for query in queries:
            for plan in await _plans(driver, query):
                shown = _describe(plan)
                assert _index_nodes(plan, _PRIMARY_KEY) and _index_nodes(plan, "runlane_records_pkey"), shown
                assert not [
                    node
                    for node in _nodes(plan["Plan"])
                    if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in _BIG_TABLES
                ], f"a sequential scan of a Runlane table:\n{shown}"
            analyzed = await driver.explain(query, analyze=True)
            (records,) = _index_nodes(analyzed, "runlane_records_pkey")
            assert records["Actual Rows"] == query.limit + 1, _describe(analyzed)  # more rows than a page
            assert (await driver.query(query)).next_cursor is not None


# ---------------------------------------------------------------------------------------------
# Operator lists


_RUN_LISTS: dict[str, tuple[dict[str, Any], str]] = {
    "default: created_at desc": ({}, "runlane_operator_runs_by_created"),
    "created_at asc": ({"sort_direction": SortDirection.ASC}, "runlane_operator_runs_by_created"),
    "updated_at desc": ({"sort_by": RunSortField.UPDATED_AT}, "runlane_operator_runs_by_updated"),
    "status queued": ({"statuses": (RunStatus.QUEUED,)}, "runlane_operator_runs_by_status"),
    "status failed, asc": (
        {"statuses": (RunStatus.FAILED,), "sort_direction": SortDirection.ASC},
        "runlane_operator_runs_by_status",
    ),
    "status without runs": ({"statuses": (RunStatus.CANCELLED,)}, "runlane_operator_runs_by_status"),
    "two statuses": ({"statuses": (RunStatus.QUEUED, RunStatus.RUNNING)}, "runlane_operator_runs_by_created"),
    "queue": ({"queues": ("emails",)}, "runlane_operator_runs_by_created"),
    # Filters that pick few runs out of many read only those runs (schema version 3).
    "task": ({"task_ids": ("explain.rare",)}, "runlane_operator_runs_by_task"),
    "task, asc": (
        {"task_ids": ("explain.rare",), "sort_direction": SortDirection.ASC},
        "runlane_operator_runs_by_task",
    ),
    "idempotency key": ({"idempotency_key": "order-7"}, "runlane_operator_runs_by_idempotency_key"),
    "singleton key": ({"singleton_key": "account-7"}, "runlane_operator_runs_by_singleton_key"),
    "source run": ({"source_run_id": "run_parent"}, "runlane_operator_runs_by_source_run"),
    "run_at asc": ({"sort_by": RunSortField.RUN_AT, "sort_direction": SortDirection.ASC}, "runlane_operator_runs_by_availability"),
    "run_at desc": ({"sort_by": RunSortField.RUN_AT}, "runlane_operator_runs_by_availability"),
}


@pytest.mark.parametrize("case", list(_RUN_LISTS))
async def test_list_runs_pages_come_from_an_index(dataset: Dataset, case: str) -> None:
    fields, index = _RUN_LISTS[case]
    run_filter = RunFilter(environment=ENVIRONMENT, **fields)
    async with _driver(dataset) as driver:
        first = await driver.list_runs(run_filter, PaginationParams(limit=20))
        pages = [PaginationParams()]
        if first.next_cursor is not None:
            pages.append(PaginationParams(limit=20, cursor=first.next_cursor))
        for pagination in pages:
            for plan in await _plans(driver, run_filter, pagination):
                # The run_at order sorts only what each availability group's index scan returned.
                by_group = "available_missing" if run_filter.sort_by is RunSortField.RUN_AT else None
                assert_indexed(plan, index, sorted_rows_of=by_group)
                assert _index_nodes(plan, "runlane_records_pkey"), _describe(plan)  # documents and tombstones


async def test_list_run_events_of_one_run_come_from_its_primary_key(dataset: Dataset) -> None:
    by_sequence = RunEventFilter(environment=ENVIRONMENT, run_id=dataset.run_id, sort_by=RunEventSortField.SEQUENCE)
    by_time = RunEventFilter(environment=ENVIRONMENT, run_id=dataset.run_id)  # the default: occurred_at
    async with _driver(dataset) as driver:
        for plan in await _plans(driver, by_sequence):
            assert_indexed(plan, "runlane_operator_events_pkey")
        # No index orders one run's events by time: they are read by the primary key and only that
        # run's rows are sorted.
        for plan in await _plans(driver, by_time):
            assert_indexed(plan, "runlane_operator_events_pkey", sorted_rows_of="run_id")
        everything = RunEventFilter(environment=ENVIRONMENT)  # every run's events, by time
        for plan in await _plans(driver, everything):
            assert_indexed(plan, "runlane_operator_events_by_occurred")
