-- ql3.put_revision (SPEC 2, 3, 6): numbering, body hash, idempotency, every refusal (each
-- of which must leave the contract tables exactly as they were), and concurrent puts from
-- two other sessions through dblink.
BEGIN;
SELECT plan(66);
SET LOCAL client_min_messages = warning;

CREATE SCHEMA IF NOT EXISTS tests;

-- Everything this transaction writes lives under projects named 'tap02-...'.
CREATE FUNCTION tests.contract_state(p_prefix text) RETURNS text
LANGUAGE sql AS $$
    SELECT format(
        'revisions=%s revocations=%s outbox=%s pointers=[%s]',
        (SELECT count(*) FROM ql3.contract_revisions AS r WHERE starts_with(r.project_id, p_prefix)),
        (SELECT count(*)
         FROM ql3.revision_revocations AS v
         INNER JOIN ql3.contract_revisions AS r ON v.revision_id = r.revision_id
         WHERE starts_with(r.project_id, p_prefix)),
        (SELECT count(*) FROM ql3.contract_outbox AS o WHERE starts_with(o.project_id, p_prefix)),
        (SELECT string_agg(
                    format('%s/%s/%s=%s@%s', a.project_id, a.contract_family, a.contract_id,
                           a.active_revision_id, a.pointer_version),
                    ',' ORDER BY a.project_id, a.contract_family, a.contract_id)
         FROM ql3.active_revisions AS a WHERE starts_with(a.project_id, p_prefix))
    );
$$;

-- Two tests: the statement fails with exactly this SQLSTATE, and nothing was written.
CREATE FUNCTION tests.refused(p_sql text, p_errcode char(5), p_description text)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    before text := tests.contract_state('tap02-');
BEGIN
    RETURN NEXT throws_ok(p_sql, p_errcode, NULL, p_description);
    RETURN NEXT is(tests.contract_state('tap02-'), before, p_description || ': nothing written');
END;
$$;

CREATE TABLE tests.revs (name text PRIMARY KEY, revision ql3.contract_revisions NOT NULL);

-- put_revision, keeping the returned row under a name.
CREATE FUNCTION tests.put(p_name text, p_project text, p_family text, p_contract text, p_body jsonb, p_actor text)
RETURNS uuid
LANGUAGE sql AS $$
    INSERT INTO tests.revs (name, revision)
    SELECT p_name, r FROM ql3.put_revision(p_project, p_family, p_contract, p_body, p_actor) AS r
    RETURNING (revision).revision_id;
$$;

SELECT tests.put('r1', 'tap02-p', 'policy_routing', 'routing', '{"model": "m1", "n": 1}', 'alice');

-- Happy path ------------------------------------------------------------------------------

SELECT is((revision).revision_no, 1, 'the first revision of a contract is revision_no 1')
FROM tests.revs WHERE name = 'r1';

SELECT is(
    (revision).body_hash,
    ql3.digest('ql3/contract-body@v1', '{"model": "m1", "n": 1}'),
    'body_hash is digest(''ql3/contract-body@v1'', body)'
)
FROM tests.revs WHERE name = 'r1';

SELECT is(
    (revision).body_hash,
    'ade9d26ad4dc3fe97f268265f454a71745013e9505ed0aec4befe730e4eed1bd',
    'body_hash matches the SPEC 2 digest computed outside PostgreSQL'
)
FROM tests.revs WHERE name = 'r1';

SELECT row_eq(
    $$SELECT project_id, contract_family, contract_id, body, created_by
      FROM ql3.contract_revisions
      WHERE revision_id = (SELECT (revision).revision_id FROM tests.revs WHERE name = 'r1')$$,
    row('tap02-p'::text, 'policy_routing'::text, 'routing'::text, '{"model": "m1", "n": 1}'::jsonb, 'alice'::text),
    'the stored row holds the key, the body and the actor'
);

SELECT tests.put('r2', 'tap02-p', 'policy_routing', 'routing', '{"model": "m2"}', 'alice');
SELECT tests.put('r3', 'tap02-p', 'policy_routing', 'routing', '{"model": "m3"}', 'bob');

SELECT results_eq(
    $$SELECT (revision).revision_no FROM tests.revs WHERE name IN ('r1', 'r2', 'r3') ORDER BY name$$,
    ARRAY[1, 2, 3],
    'each new body of the same contract gets the next revision_no'
);

SELECT tests.put('other_contract', 'tap02-p', 'policy_routing', 'other', '{"model": "m1", "n": 1}', 'alice');
SELECT tests.put('other_project', 'tap02-q', 'policy_routing', 'routing', '{"model": "m1", "n": 1}', 'alice');
SELECT tests.put('other_family', 'tap02-p', 'channel_event', 'routing', '{"model": "m1", "n": 1}', 'alice');

SELECT results_eq(
    $$SELECT (revision).revision_no FROM tests.revs
      WHERE name IN ('other_contract', 'other_project', 'other_family') ORDER BY name$$,
    ARRAY[1, 1, 1],
    'numbering is per (project, family, contract): the same body elsewhere starts again at 1'
);

SELECT is(
    (SELECT count(*) FROM (SELECT DISTINCT (r.revision).revision_id FROM tests.revs AS r) AS d),
    6::bigint,
    'the same body under another contract, project or family is a separate revision'
);

SELECT is_empty(
    $$SELECT * FROM ql3.active_revision('tap02-p', 'policy_routing', 'routing')$$,
    'put_revision does not activate anything'
);

-- Idempotency: same body (as canonical JSON) -> same revision, nothing written.

CREATE TABLE tests.snapshots (label text PRIMARY KEY, snapshot text NOT NULL);
INSERT INTO tests.snapshots (label, snapshot) VALUES ('before replay', tests.contract_state('tap02-'));

SELECT tests.put('r1_again', 'tap02-p', 'policy_routing', 'routing', '{"n": 1, "model": "m1"}', 'carol');
SELECT tests.put('r1_decimal', 'tap02-p', 'policy_routing', 'routing', '{"model": "m1", "n": 1.0}', 'carol');

SELECT is(
    (SELECT (revision).revision_id FROM tests.revs WHERE name = 'r1_again'),
    (SELECT (revision).revision_id FROM tests.revs WHERE name = 'r1'),
    'putting the same body again returns the existing revision_id'
);

SELECT is(
    (SELECT revision FROM tests.revs WHERE name = 'r1_again'),
    (SELECT revision FROM tests.revs WHERE name = 'r1'),
    'the replay returns the stored row unchanged (revision_no, created_by, created_at)'
);

SELECT is(
    (SELECT (revision).revision_id FROM tests.revs WHERE name = 'r1_decimal'),
    (SELECT (revision).revision_id FROM tests.revs WHERE name = 'r1'),
    'bodies equal as canonical JSON (1.0 and 1) are the same revision'
);

SELECT is(
    tests.contract_state('tap02-'),
    (SELECT snapshot FROM tests.snapshots WHERE label = 'before replay'),
    'a replayed put writes no row'
);

SELECT is(
    (SELECT max(revision_no) FROM ql3.contract_revisions
     WHERE project_id = 'tap02-p' AND contract_family = 'policy_routing' AND contract_id = 'routing'),
    3,
    'a replay does not consume a revision_no'
);

-- Limits that are still accepted.

SELECT is(
    octet_length(ql3.jcs(jsonb_build_object('a', repeat('x', 24568)))),
    24576,
    'fixture: {"a": 24568 x} is exactly 24576 bytes of canonical JSON'
);

SELECT lives_ok(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'big', jsonb_build_object('a', repeat('x', 24568)),
                              'alice')$$,
    'a body of exactly 24576 canonical bytes is accepted'
);

SELECT lives_ok(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'safe-numbers',
                              '{"max": 9007199254740991, "min": -9007199254740991, "f": 0.5}', 'alice')$$,
    'numbers within -(2^53-1)..2^53-1 are accepted'
);

SELECT lives_ok(
    $$SELECT ql3.put_revision('tap02-' || repeat('p', 122), 'policy_routing', repeat('c', 128), '{}', repeat('a', 128))$$,
    'identifiers of exactly 128 characters are accepted'
);

SELECT lives_ok(
    $$SELECT ql3.put_revision('tap02-' || repeat('é', 122), 'policy_routing', repeat('é', 128), '{}',
                              repeat('é', 128))$$,
    'the 128 limit counts characters, not bytes'
);

-- Refusals: each with its SQLSTATE, each writing nothing ------------------------------------

SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'no_such_family', 'routing', '{}', 'alice')$$,
    'Q3V01', 'an unknown contract family is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', '', 'routing', '{}', 'alice')$$,
    'Q3V01', 'an empty contract family is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '[{"model": "m1"}]', 'alice')$$,
    'Q3V01', 'an array body is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '"model"', 'alice')$$,
    'Q3V01', 'a string body is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', 'null', 'alice')$$,
    'Q3V01', 'a JSON null body is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', NULL, 'alice')$$,
    'Q3V01', 'an SQL NULL body is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '{"n": 9007199254740992}', 'alice')$$,
    'Q3V01', 'a body number of 2^53 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '{"a": [{"n": -1e20}]}', 'alice')$$,
    'Q3V01', 'a nested body number of -1e20 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '{"n": 9007199254740991.5}', 'alice')$$,
    'Q3V01', 'a non-integral body number above 2^53-1 is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'big', jsonb_build_object('a', repeat('x', 24569)),
                              'alice')$$,
    'Q3V02', 'a body of 24577 canonical bytes is QL3_RECORD_TOO_LARGE'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'big', jsonb_build_object('a', repeat('é', 12285)),
                              'alice')$$,
    'Q3V02', 'the 24 KiB limit counts UTF-8 bytes, not characters'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision(repeat('p', 129), 'policy_routing', 'routing', '{}', 'alice')$$,
    'Q3V03', 'a project_id of 129 characters is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', repeat('c', 129), '{}', 'alice')$$,
    'Q3V03', 'a contract_id of 129 characters is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '{}', repeat('a', 129))$$,
    'Q3V03', 'an actor of 129 characters is QL3_IDENTIFIER_TOO_LONG'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('', 'policy_routing', 'routing', '{}', 'alice')$$,
    'Q3V01', 'an empty project_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', '', '{}', 'alice')$$,
    'Q3V01', 'an empty contract_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '{}', '')$$,
    'Q3V01', 'an empty actor is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision(NULL, 'policy_routing', 'routing', '{}', 'alice')$$,
    'Q3V01', 'a NULL project_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', NULL, '{}', 'alice')$$,
    'Q3V01', 'a NULL contract_id is QL3_INVALID_ARGUMENT'
);
SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-p', 'policy_routing', 'routing', '{}', NULL)$$,
    'Q3V01', 'a NULL actor is QL3_INVALID_ARGUMENT'
);

-- Concurrent puts: two other sessions (dblink) commit under a unique 'tap02c-<uuid>' project.
-- This runs before the failure injection below, whose CREATE TRIGGER would lock
-- contract_revisions against the other sessions until this transaction ends.

CREATE TABLE tests.ctx (key text PRIMARY KEY, value text NOT NULL);
INSERT INTO tests.ctx (key, value) VALUES ('project', 'tap02c-' || gen_random_uuid());

CREATE FUNCTION tests.ctx(p_key text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT c.value FROM tests.ctx AS c WHERE c.key = p_key;
$$;

-- The put_revision statement, for another session, of body {"v": p_v} under the unique project.
CREATE FUNCTION tests.put_sql(p_v integer) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT format(
        'SELECT revision_id, revision_no FROM ql3.put_revision(%L, ''policy_routing'', ''c'', %L, ''tap02'')',
        tests.ctx('project'), jsonb_build_object('v', p_v)
    );
$$;

-- Waits (up to 10 s) until the backend p_pid waits for a lock; true if it does.
CREATE FUNCTION tests.await_lock_wait(p_pid integer) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..1000 LOOP
        PERFORM pg_stat_clear_snapshot();
        IF EXISTS (SELECT 1 FROM pg_stat_activity AS a WHERE a.pid = p_pid AND a.wait_event_type = 'Lock') THEN
            RETURN TRUE;
        END IF;
        PERFORM pg_sleep(0.01);
    END LOOP;
    RETURN FALSE;
END;
$$;

CREATE TABLE tests.remote (label text PRIMARY KEY, revision_id uuid NOT NULL, revision_no integer NOT NULL);

SELECT dblink_connect(
    'tap02_a', format('host=127.0.0.1 port=%s dbname=%s user=postgres', current_setting('port'), current_database())
);
SELECT dblink_connect(
    'tap02_b', format('host=127.0.0.1 port=%s dbname=%s user=postgres', current_setting('port'), current_database())
);
INSERT INTO tests.ctx (key, value)
SELECT
    'b_pid' AS key,
    t.pid::text AS value
FROM dblink('tap02_b', 'SELECT pg_backend_pid()') AS t (pid integer);

-- Session a holds the contract's pointer lock while b replays the same body.
SELECT dblink_exec('tap02_a', 'BEGIN');
INSERT INTO tests.remote (label, revision_id, revision_no)
SELECT
    'a replay' AS label,
    t.revision_id,
    t.revision_no
FROM dblink('tap02_a', tests.put_sql(1)) AS t (revision_id uuid, revision_no integer);
SELECT dblink_send_query('tap02_b', tests.put_sql(1));

SELECT ok(tests.await_lock_wait(tests.ctx('b_pid')::integer), 'a concurrent put of the same contract waits');

SELECT dblink_exec('tap02_a', 'COMMIT');
INSERT INTO tests.remote (label, revision_id, revision_no)
SELECT
    'b replay' AS label,
    t.revision_id,
    t.revision_no
FROM dblink_get_result('tap02_b') AS t (revision_id uuid, revision_no integer);
SELECT t.* FROM dblink_get_result('tap02_b') AS t (revision_id uuid, revision_no integer);

SELECT is(
    (SELECT revision_id FROM tests.remote WHERE label = 'b replay'),
    (SELECT revision_id FROM tests.remote WHERE label = 'a replay'),
    'a concurrent replay of the same body returns the revision the other session committed'
);

-- Same again with different bodies: the waiting put takes the next revision_no.
SELECT dblink_exec('tap02_a', 'BEGIN');
INSERT INTO tests.remote (label, revision_id, revision_no)
SELECT
    'a next' AS label,
    t.revision_id,
    t.revision_no
FROM dblink('tap02_a', tests.put_sql(2)) AS t (revision_id uuid, revision_no integer);
SELECT dblink_send_query('tap02_b', tests.put_sql(3));

SELECT ok(tests.await_lock_wait(tests.ctx('b_pid')::integer), 'a concurrent put of another body waits');

SELECT dblink_exec('tap02_a', 'COMMIT');
INSERT INTO tests.remote (label, revision_id, revision_no)
SELECT
    'b next' AS label,
    t.revision_id,
    t.revision_no
FROM dblink_get_result('tap02_b') AS t (revision_id uuid, revision_no integer);
SELECT t.* FROM dblink_get_result('tap02_b') AS t (revision_id uuid, revision_no integer);

SELECT results_eq(
    $$SELECT revision_no FROM tests.remote WHERE label IN ('a next', 'b next') ORDER BY label$$,
    ARRAY[2, 3],
    'concurrent puts of different bodies get consecutive revision_no values'
);

-- Under REPEATABLE READ the waiting put cannot see the committed revision: it should fail
-- retryably (40001), as PostgreSQL does for any other write conflict at that level.
SELECT dblink_exec('tap02_b', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT t.* FROM dblink('tap02_b', 'SELECT 1') AS t (one integer);
SELECT t.* FROM dblink('tap02_a', tests.put_sql(4)) AS t (revision_id uuid, revision_no integer);

SELECT throws_ok(
    format('SELECT * FROM dblink(%L, %L) AS t (revision_id uuid, revision_no integer)', 'tap02_b', tests.put_sql(5)),
    '40001', NULL,
    'a put under REPEATABLE READ that raced a committed put fails with serialization_failure, not 23505'
);

SELECT dblink_exec('tap02_b', 'ROLLBACK');
SELECT dblink_disconnect('tap02_a');
SELECT dblink_disconnect('tap02_b');

-- A failure after the pointer row was created leaves no pointer row behind.
CREATE FUNCTION tests.fail_revision_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'QT001', MESSAGE = 'injected failure';
END;
$$;
CREATE TRIGGER tap02_fail_insert BEFORE INSERT ON ql3.contract_revisions
FOR EACH ROW WHEN (new.project_id = 'tap02-fail') EXECUTE FUNCTION tests.fail_revision_insert();

SELECT * FROM tests.refused(
    $$SELECT ql3.put_revision('tap02-fail', 'policy_routing', 'routing', '{}', 'alice')$$,
    'QT001', 'a put that fails at the insert'
);
SELECT is_empty(
    $$SELECT * FROM ql3.active_revisions WHERE project_id = 'tap02-fail'$$,
    'a failed put leaves no pointer row'
);

SELECT * FROM finish();
ROLLBACK;
