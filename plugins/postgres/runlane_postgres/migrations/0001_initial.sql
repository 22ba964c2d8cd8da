-- Runlane storage schema, version 3 (PostgreSQL 13 or newer).
-- Written for the schema "public"; runlane_postgres.postgres_migration_sql(schema) gives it for any schema.
-- Apply it with `runlane postgres migrate` or through your own migration tool, in one transaction
-- (psql --single-transaction): every statement is idempotent, and the lock below makes concurrent
-- applications wait for each other, which it can only do for a whole transaction.
SELECT pg_advisory_xact_lock(7318952210413375533);

-- Created only when it does not exist yet: CREATE SCHEMA IF NOT EXISTS would need CREATE on the
-- database even then, which the owner of an existing schema may not have.
DO $runlane$
BEGIN
    IF to_regnamespace('"public"') IS NULL THEN
        CREATE SCHEMA "public";
    END IF;
END
$runlane$;

-- min_driver_version: the oldest driver (its SCHEMA_VERSION) that may still use the schema once this
-- version is applied; NULL means the version itself. A version that only adds (an index, say) names
-- an older one, so workers of the release before it keep starting during a rollout or a rollback.
CREATE TABLE IF NOT EXISTS "public".runlane_schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    min_driver_version integer
);

CREATE SEQUENCE IF NOT EXISTS "public".runlane_record_versions AS bigint;

-- One row per logical record. The document is the canonical JSON envelope, stored once and exactly.
-- indexes lists the record's index entries as "name,partition,sort" separated by spaces.
CREATE TABLE IF NOT EXISTS "public".runlane_records (
    key text COLLATE "C" PRIMARY KEY,
    version bigint NOT NULL,
    document json NOT NULL,
    byte_size integer NOT NULL,
    indexes text COLLATE "C" NOT NULL DEFAULT ''
) WITH (fillfactor = 85);

-- One row per index entry: the primary key serves every index name's ordered range plan.
CREATE TABLE IF NOT EXISTS "public".runlane_index_rows (
    index_name text COLLATE "C" NOT NULL,
    partition text COLLATE "C" NOT NULL,
    sort text COLLATE "C" NOT NULL,
    key text COLLATE "C" NOT NULL,
    PRIMARY KEY (index_name, partition, sort, key)
);

-- Operator read projection of run records (runlane.storage.operator_sql.OPERATOR_RUN_COLUMNS).
CREATE TABLE IF NOT EXISTS "public".runlane_operator_runs (
    environment text COLLATE "C" NOT NULL,
    run_id text COLLATE "C" NOT NULL,
    record_key text COLLATE "C" NOT NULL,
    tombstone_key text COLLATE "C" NOT NULL,
    status text COLLATE "C" NOT NULL,
    task_id text COLLATE "C" NOT NULL,
    queue text COLLATE "C" NOT NULL,
    idempotency_key text COLLATE "C",
    singleton_key text COLLATE "C",
    source_run_id text COLLATE "C",
    created_at text COLLATE "C" NOT NULL,
    updated_at text COLLATE "C" NOT NULL,
    run_at text COLLATE "C",
    available_missing integer NOT NULL,
    available_at text COLLATE "C" NOT NULL,
    PRIMARY KEY (environment, run_id)
);
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_created
    ON "public".runlane_operator_runs (environment, created_at, run_id);
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_updated
    ON "public".runlane_operator_runs (environment, updated_at, run_id);
-- A status filter reads its own runs in created order instead of scanning past the other statuses.
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_status
    ON "public".runlane_operator_runs (environment, status, created_at, run_id);
-- The run_at order reads the runs with and without an availability apart, each in this order.
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_availability
    ON "public".runlane_operator_runs (environment, available_missing, available_at, run_id);

-- Operator read projection of run event records (OPERATOR_EVENT_COLUMNS).
CREATE TABLE IF NOT EXISTS "public".runlane_operator_events (
    environment text COLLATE "C" NOT NULL,
    run_id text COLLATE "C" NOT NULL,
    sequence text COLLATE "C" NOT NULL,
    record_key text COLLATE "C" NOT NULL,
    type text COLLATE "C" NOT NULL,
    occurred_at text COLLATE "C" NOT NULL,
    PRIMARY KEY (environment, run_id, sequence)
);
CREATE INDEX IF NOT EXISTS runlane_operator_events_by_occurred
    ON "public".runlane_operator_events (environment, occurred_at, run_id, sequence);

-- Applies one transaction attempt, described by one jsonb document (absent members mean "none"):
--   l: advisory locks [[key, shared], ...] in the order to take them (the caller sorts them; stream
--      heads, when the attempt reads or writes one as a record, come after every other key)
--   d: dependencies [[record key, version or null for absent], ...]
--   x: record keys to delete
--   c / p: records to create / replace [[key, document text, byte size, index entries], ...]
--   u / i: index rows to remove / add [[index name, partition, sort, record key], ...]
--   ur / r: operator run rows to remove [[environment, run id], ...] / write (OPERATOR_RUN_COLUMNS)
--   ue / e: operator event rows to remove [[environment, run id, sequence], ...] / write
--   n: wake hints [channel, [queue, ...]]: pg_notify(channel, queue) each, delivered at commit
--   a: ordered append {h: head key, l: head lock, n: index name, p: encoded partition,
--      k: record key prefix, v: [[text before the position digits, text after them, byte size
--      without them], ...]}; the appended records' index entries restate their keys, so they get
--      no index rows (see version 2 below)
-- Returns commit_status 0 (committed) or 1 (a read or expected version changed: nothing was written,
-- replay the attempt). A stream head that cannot be appended to raises SQLSTATE RL002 (corrupt head),
-- RL003 (positions exhausted) or RL004 (records already exist past the head), with the head's text
-- as the error detail; RL001 is any other broken invariant. Raising rolls back the whole statement.
-- Existing rows are checked, replaced and deleted one primary key at a time: a join of a table
-- against the payload's list is planned once per session, and from a table that has grown since
-- it was last analyzed it can be a scan of the whole table on every commit.
-- Point locks come first and in one global order, so attempts serialize on the keys they share
-- without deadlocking; every later statement takes a fresh snapshot and sees whatever committed
-- before. The stream head's lock is taken last, after the point writes, so appenders to one stream
-- hold it only for the append itself and the commit.
CREATE OR REPLACE FUNCTION "public".runlane_commit(
    p jsonb,
    OUT commit_status integer,
    OUT commit_detail text
)
LANGUAGE plpgsql
-- The statements' plans never depend on the payload's values: plan them once per connection.
SET plan_cache_mode = force_generic_plan
AS $runlane$
DECLARE
    appended jsonb := p -> 'a';
    head_text text;
    head_digits text;
    first_position numeric;
    value_count integer := 0;
    changed integer;
    entry jsonb;
    current_version bigint;
BEGIN
    commit_status := 0;
    IF p ? 'l' THEN
        PERFORM CASE WHEN (e ->> 1)::boolean THEN pg_advisory_xact_lock_shared((e ->> 0)::bigint)
                     ELSE pg_advisory_xact_lock((e ->> 0)::bigint) END
        FROM jsonb_array_elements(p -> 'l') AS e;
    END IF;

    IF p ? 'd' THEN
        -- One statement for every dependency: each key is looked up by a subquery on the primary key.
        IF EXISTS (
            SELECT FROM jsonb_array_elements(p -> 'd') AS e
            WHERE (SELECT r.version FROM "public".runlane_records AS r WHERE r.key = e ->> 0)
                  IS DISTINCT FROM (e ->> 1)::bigint
        ) THEN
            commit_status := 1;
            RETURN;
        END IF;
    END IF;

    IF p ? 'n' THEN
        PERFORM pg_notify(p -> 'n' ->> 0, q) FROM jsonb_array_elements_text(p -> 'n' -> 1) AS q;
    END IF;

    IF p ? 'u' THEN
        FOR entry IN SELECT e.value FROM jsonb_array_elements(p -> 'u') AS e LOOP
            DELETE FROM "public".runlane_index_rows AS x
            WHERE x.index_name = entry ->> 0 AND x.partition = entry ->> 1 AND x.sort = entry ->> 2
              AND x.key = entry ->> 3;
            GET DIAGNOSTICS changed = ROW_COUNT;
            IF changed <> 1 THEN
                RAISE EXCEPTION 'runlane: an index row of a stored record is missing' USING ERRCODE = 'RL001';
            END IF;
        END LOOP;
    END IF;

    IF p ? 'x' THEN
        FOR entry IN SELECT e.value FROM jsonb_array_elements(p -> 'x') AS e LOOP
            DELETE FROM "public".runlane_records AS r WHERE r.key = entry #>> '{}';
            GET DIAGNOSTICS changed = ROW_COUNT;
            IF changed <> 1 THEN
                RAISE EXCEPTION 'runlane: a record to delete disappeared under its lock' USING ERRCODE = 'RL001';
            END IF;
        END LOOP;
    END IF;

    IF p ? 'c' THEN
        INSERT INTO "public".runlane_records (key, version, document, byte_size, indexes)
        SELECT e ->> 0, nextval('"public".runlane_record_versions'), (e ->> 1)::json,
               (e ->> 2)::integer, e ->> 3
        FROM jsonb_array_elements(p -> 'c') AS e;
    END IF;

    IF p ? 'p' THEN
        FOR entry IN SELECT e.value FROM jsonb_array_elements(p -> 'p') AS e LOOP
            UPDATE "public".runlane_records AS r
            SET version = nextval('"public".runlane_record_versions'), document = (entry ->> 1)::json,
                byte_size = (entry ->> 2)::integer, indexes = entry ->> 3
            WHERE r.key = entry ->> 0;
            GET DIAGNOSTICS changed = ROW_COUNT;
            IF changed <> 1 THEN
                RAISE EXCEPTION 'runlane: a record to replace disappeared under its lock' USING ERRCODE = 'RL001';
            END IF;
        END LOOP;
    END IF;

    IF p ? 'i' THEN
        INSERT INTO "public".runlane_index_rows (index_name, partition, sort, key)
        SELECT e ->> 0, e ->> 1, e ->> 2, e ->> 3 FROM jsonb_array_elements(p -> 'i') AS e;
    END IF;

    IF p ? 'ur' THEN
        FOR entry IN SELECT e.value FROM jsonb_array_elements(p -> 'ur') AS e LOOP
            DELETE FROM "public".runlane_operator_runs AS o
            WHERE o.environment = entry ->> 0 AND o.run_id = entry ->> 1;
        END LOOP;
    END IF;
    IF p ? 'r' THEN
        INSERT INTO "public".runlane_operator_runs AS o (
            environment, run_id, record_key, tombstone_key, status, task_id, queue, idempotency_key,
            singleton_key, source_run_id, created_at, updated_at, run_at, available_missing, available_at
        )
        SELECT e ->> 0, e ->> 1, e ->> 2, e ->> 3, e ->> 4, e ->> 5, e ->> 6, e ->> 7, e ->> 8, e ->> 9,
               e ->> 10, e ->> 11, e ->> 12, (e ->> 13)::integer, e ->> 14
        FROM jsonb_array_elements(p -> 'r') AS e
        ON CONFLICT (environment, run_id) DO UPDATE
        SET record_key = EXCLUDED.record_key, tombstone_key = EXCLUDED.tombstone_key, status = EXCLUDED.status,
            task_id = EXCLUDED.task_id, queue = EXCLUDED.queue, idempotency_key = EXCLUDED.idempotency_key,
            singleton_key = EXCLUDED.singleton_key, source_run_id = EXCLUDED.source_run_id,
            created_at = EXCLUDED.created_at, updated_at = EXCLUDED.updated_at, run_at = EXCLUDED.run_at,
            available_missing = EXCLUDED.available_missing, available_at = EXCLUDED.available_at;
    END IF;

    IF p ? 'ue' THEN
        FOR entry IN SELECT e.value FROM jsonb_array_elements(p -> 'ue') AS e LOOP
            DELETE FROM "public".runlane_operator_events AS o
            WHERE o.environment = entry ->> 0 AND o.run_id = entry ->> 1 AND o.sequence = entry ->> 2;
        END LOOP;
    END IF;
    IF p ? 'e' THEN
        INSERT INTO "public".runlane_operator_events AS o (
            environment, run_id, sequence, record_key, type, occurred_at
        )
        SELECT e ->> 0, e ->> 1, e ->> 2, e ->> 3, e ->> 4, e ->> 5
        FROM jsonb_array_elements(p -> 'e') AS e
        ON CONFLICT (environment, run_id, sequence) DO UPDATE
        SET record_key = EXCLUDED.record_key, type = EXCLUDED.type, occurred_at = EXCLUDED.occurred_at;
    END IF;
    IF appended IS NULL THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock((appended ->> 'l')::bigint);
    value_count := jsonb_array_length(appended -> 'v');
    SELECT r.document::text INTO head_text
    FROM "public".runlane_records AS r WHERE r.key = appended ->> 'h';
    IF NOT FOUND THEN
        first_position := 1;
    ELSE
        -- The head is exactly '{"schemaVersion":1,"value":{"next_position":"N"}}' with N in 1..20 digits,
        -- no leading zero. Plain string tests, not a regular expression: this runs on every commit
        -- that appends, and a regular expression with a bounded repeat costs tens of microseconds.
        head_digits := substr(head_text, 46, greatest(length(head_text) - 48, 0));
        IF left(head_text, 45) <> '{"schemaVersion":1,"value":{"next_position":"' OR right(head_text, 3) <> '"}}'
           OR length(head_digits) NOT BETWEEN 1 AND 20 OR left(head_digits, 1) = '0'
           OR translate(head_digits, '0123456789', '') <> '' THEN
            RAISE EXCEPTION 'runlane: the stream head is corrupt' USING ERRCODE = 'RL002', DETAIL = head_text;
        END IF;
        first_position := head_digits::numeric;
    END IF;
    IF first_position + value_count > 18446744073709551615 THEN
        RAISE EXCEPTION 'runlane: the stream positions are exhausted' USING ERRCODE = 'RL003',
            DETAIL = coalesce(head_text, '');
    END IF;
    INSERT INTO "public".runlane_records AS r (key, version, document, byte_size, indexes)
    SELECT (appended ->> 'k') || v.sort_hex, nextval('"public".runlane_record_versions'),
           (v.before || v.digits || v.after)::json, v.size + length(v.digits),
           (appended ->> 'n') || ',' || (appended ->> 'p') || ',' || v.sort_hex
    FROM (
        SELECT e ->> 0 AS before, e ->> 1 AS after, (e ->> 2)::integer AS size, position.digits,
               encode(convert_to(lpad(position.digits, 20, '0'), 'UTF8'), 'hex') AS sort_hex
        FROM jsonb_array_elements(appended -> 'v') WITH ORDINALITY AS a(e, n),
             LATERAL (SELECT (first_position + a.n - 1)::text AS digits) AS position
    ) AS v
    ON CONFLICT (key) DO NOTHING;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed <> value_count THEN
        RAISE EXCEPTION 'runlane: the stream already holds records past its head' USING ERRCODE = 'RL004',
            DETAIL = coalesce(head_text, '');
    END IF;
    head_text := '{"schemaVersion":1,"value":{"next_position":"' || (first_position + value_count)::text || '"}}';
    INSERT INTO "public".runlane_records AS r (key, version, document, byte_size, indexes)
    VALUES (appended ->> 'h', nextval('"public".runlane_record_versions'), head_text::json,
            octet_length(head_text), '')
    ON CONFLICT (key) DO UPDATE
    SET version = EXCLUDED.version, document = EXCLUDED.document, byte_size = EXCLUDED.byte_size,
        indexes = EXCLUDED.indexes;
END;
$runlane$;

-- Applies several transaction attempts in one transaction, so they share one WAL flush (the driver's
-- group commit): first every advisory lock of every attempt, in the one global order given by the
-- caller (point keys sorted, then stream heads sorted; exclusive wherever any attempt needs it), then
-- each attempt's runlane_commit in order, in a subtransaction of its own: a later attempt's checks
-- see the earlier ones' writes, and an attempt that raises is rolled back alone. Returns one row per
-- attempt, in order: commit_status 0 or 1 as runlane_commit returns it, or 2 when it raised, with
-- the error's SQLSTATE, message and detail.
CREATE OR REPLACE FUNCTION "public".runlane_commit_batch(locks jsonb, attempts jsonb)
RETURNS TABLE (commit_status integer, commit_state text, commit_message text, commit_detail text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $runlane$
DECLARE
    attempt jsonb;
BEGIN
    PERFORM CASE WHEN (e ->> 1)::boolean THEN pg_advisory_xact_lock_shared((e ->> 0)::bigint)
                 ELSE pg_advisory_xact_lock((e ->> 0)::bigint) END
    FROM jsonb_array_elements(locks) AS e;
    FOR attempt IN SELECT a.value FROM jsonb_array_elements(attempts) AS a LOOP
        commit_state := NULL;
        commit_message := NULL;
        commit_detail := NULL;
        BEGIN
            SELECT c.commit_status INTO commit_status FROM "public".runlane_commit(attempt) AS c;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS commit_state = RETURNED_SQLSTATE, commit_message = MESSAGE_TEXT,
                commit_detail = PG_EXCEPTION_DETAIL;
            commit_status := 2;
        END;
        RETURN NEXT;
    END LOOP;
END;
$runlane$;

INSERT INTO "public".runlane_schema_migrations (version, name)
VALUES (1, '0001_initial')
ON CONFLICT (version) DO NOTHING;

-- Version 2: an index entry that restates its record's key (runlane.storage.key_order: a run's events
-- by run, its steps by run, the ordered-append records of a stream) has no index row; the records' own
-- key order serves that part of the index. Rows written for such entries before are dropped.
DELETE FROM "public".runlane_index_rows AS x
WHERE x.index_name IN ('run_events_by_run', 'run_steps_by_run', 'observation_stream')
  AND x.key = encode(convert_to(CASE x.index_name WHEN 'run_events_by_run' THEN 'run_events'
                                                  WHEN 'run_steps_by_run' THEN 'run_steps'
                                                  ELSE 'observation_records' END, 'UTF8'), 'hex')
              || '/' || x.partition || '/' || x.sort
  AND NOT EXISTS (SELECT FROM "public".runlane_schema_migrations AS m WHERE m.version = 2);

INSERT INTO "public".runlane_schema_migrations (version, name)
VALUES (2, '0002_key_ordered_indexes')
ON CONFLICT (version) DO NOTHING;

-- Version 3: indexes for the operator list's filters that pick few runs out of many (a task, an
-- idempotency or singleton key, the children of a run), each in created order like the list itself.
-- The key columns are usually empty, so their indexes hold only the runs that have one. Building
-- them on a large table blocks writes to runlane_operator_runs until they are built; to avoid that,
-- create them first with CREATE INDEX CONCURRENTLY under these names, and this finds them there.
ALTER TABLE "public".runlane_schema_migrations ADD COLUMN IF NOT EXISTS min_driver_version integer;
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_task
    ON "public".runlane_operator_runs (environment, task_id, created_at, run_id);
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_idempotency_key
    ON "public".runlane_operator_runs (environment, idempotency_key, created_at, run_id)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_singleton_key
    ON "public".runlane_operator_runs (environment, singleton_key, created_at, run_id)
    WHERE singleton_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_source_run
    ON "public".runlane_operator_runs (environment, source_run_id, created_at, run_id)
    WHERE source_run_id IS NOT NULL;

INSERT INTO "public".runlane_schema_migrations (version, name, min_driver_version)
VALUES (3, '0003_operator_filter_indexes', 2)
ON CONFLICT (version) DO NOTHING;
