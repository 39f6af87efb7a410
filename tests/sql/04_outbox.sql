-- The contract outbox (SPEC 3, 7): NOTIFY at COMMIT only and disjoint SKIP LOCKED claims
-- (both seen from other sessions through dblink), then claim_outbox, mark_outbox_delivered,
-- mark_outbox_failed, outbox_backlog and the guard trigger inside this transaction.
--
-- The dblink part commits real rows under a unique 'tap04-<uuid>' project and marks them
-- delivered before it ends, so later files see no undelivered leftovers. It runs before
-- this transaction locks any outbox row, so the other sessions never wait on it.
BEGIN;
SELECT plan(59);
SET LOCAL client_min_messages = warning;

\ir lib/outbox_helpers.sql
INSERT INTO tests.ctx (key, value) VALUES ('project', 'tap04-' || gen_random_uuid());

-- Over dblink: SKIP LOCKED claim of up to p_limit rows in the remote session's transaction.
CREATE FUNCTION tests.remote_claim(p_conn text, p_limit integer) RETURNS SETOF bigint
LANGUAGE sql AS $$
    SELECT t.seq FROM dblink(p_conn, format('SELECT seq FROM ql3.claim_outbox(%s)', p_limit)) AS t (seq bigint);
$$;

CREATE TABLE tests.notes (notify_name text, be_pid integer, extra text);
CREATE TABLE tests.claims (claimer text NOT NULL, seq bigint NOT NULL);

-- NOTIFY is delivered at COMMIT, and only then ------------------------------------------------

SELECT dblink_connect('tap04_l', tests.dsn());
SELECT dblink_connect('tap04_w', tests.dsn());
SELECT dblink_exec('tap04_l', 'LISTEN ql3_contract_outbox');
INSERT INTO tests.ctx (key, value)
SELECT
    'writer_pid' AS key,
    t.pid::text AS value
FROM dblink('tap04_w', 'SELECT pg_backend_pid()') AS t (pid integer);

SELECT dblink_exec('tap04_w', 'BEGIN');
SELECT tests.remote_activate('tap04_w', 'rolled-back', 1);
SELECT dblink_exec('tap04_w', 'ROLLBACK');

SELECT is(
    (SELECT count(*) FROM tests.poll('tap04_l') AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    0::bigint,
    'a rolled-back activation notifies nobody'
);

SELECT dblink_exec('tap04_w', 'BEGIN');
INSERT INTO tests.ctx (key, value) VALUES ('seq', tests.remote_activate('tap04_w', 'committed', 1)::text);

SELECT is(
    (SELECT count(*) FROM tests.poll('tap04_l') AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    0::bigint,
    'an activation notifies nobody before its COMMIT'
);

SELECT dblink_exec('tap04_w', 'COMMIT');
INSERT INTO tests.notes (notify_name, be_pid, extra)
SELECT
    n.notify_name,
    n.be_pid,
    n.extra
FROM tests.poll('tap04_l') AS n;

SELECT is(
    (SELECT count(*) FROM tests.notes AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    1::bigint,
    'a committed activation notifies exactly once'
);

SELECT is(
    (SELECT n.extra::jsonb FROM tests.notes AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    jsonb_build_object(
        'seq', (SELECT c.value::bigint FROM tests.ctx AS c WHERE c.key = 'seq'), 'project_id', tests.p()
    ),
    'the payload is the small JSON {seq, project_id} of the committed outbox row'
);

SELECT is(
    (SELECT n.notify_name FROM tests.notes AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    'ql3_contract_outbox',
    'the notification is on channel ql3_contract_outbox'
);

SELECT is(
    (SELECT n.be_pid FROM tests.notes AS n WHERE n.extra::jsonb ->> 'project_id' = tests.p()),
    (SELECT c.value::integer FROM tests.ctx AS c WHERE c.key = 'writer_pid'),
    'the notification comes from the committing session'
);

-- Concurrent claims are disjoint -------------------------------------------------------------

SELECT tests.remote_activate('tap04_w', 'claims', g.n) FROM generate_series(1, 6) AS g (n);

SELECT dblink_connect('tap04_a', tests.dsn());
SELECT dblink_connect('tap04_b', tests.dsn());
SELECT dblink_exec('tap04_a', 'BEGIN');
SELECT dblink_exec('tap04_b', 'BEGIN');
INSERT INTO tests.claims (claimer, seq)
SELECT
    'a' AS claimer,
    s.seq
FROM tests.remote_claim('tap04_a', 3) AS s (seq);
INSERT INTO tests.claims (claimer, seq)
SELECT
    'b' AS claimer,
    s.seq
FROM tests.remote_claim('tap04_b', 3) AS s (seq);

SELECT is(
    (SELECT count(*) FROM tests.claims WHERE claimer = 'a'),
    3::bigint,
    'the first claimer gets a full batch'
);

SELECT is(
    (SELECT count(*) FROM tests.claims WHERE claimer = 'b'),
    3::bigint,
    'the second claimer, while the first still holds its batch, gets a full batch too'
);

SELECT is_empty(
    $$SELECT seq FROM tests.claims WHERE claimer = 'a' INTERSECT SELECT seq FROM tests.claims WHERE claimer = 'b'$$,
    'two concurrent claims never share a row (SKIP LOCKED)'
);

SELECT ok(
    (SELECT max(seq) FROM tests.claims WHERE claimer = 'a') < (SELECT min(seq) FROM tests.claims WHERE claimer = 'b'),
    'claims are taken in seq order: the second claimer gets the rows after the first one''s'
);

SELECT dblink_exec('tap04_a', 'ROLLBACK');
INSERT INTO tests.claims (claimer, seq)
SELECT
    'b again' AS claimer,
    s.seq
FROM tests.remote_claim('tap04_b', 3) AS s (seq);

SELECT set_eq(
    $$SELECT seq FROM tests.claims WHERE claimer = 'b again'$$,
    $$SELECT seq FROM tests.claims WHERE claimer = 'a'$$,
    'a rolled-back claim releases its rows, and they are claimed first again'
);

SELECT dblink_exec('tap04_b', 'ROLLBACK');

-- Leave nothing undelivered behind for later files.
SELECT is(
    (SELECT t.n
     FROM dblink(
         'tap04_w',
         format('SELECT ql3.mark_outbox_delivered(array_agg(seq)) FROM ql3.contract_outbox WHERE project_id = %L',
                tests.p())
     ) AS t (n integer)),
    7,
    'another session marks the 7 committed rows delivered (1 notified + 6 claimed)'
);

SELECT dblink_disconnect('tap04_l');
SELECT dblink_disconnect('tap04_w');
SELECT dblink_disconnect('tap04_a');
SELECT dblink_disconnect('tap04_b');

SELECT is(dblink_get_connections(), NULL, 'every dblink connection is closed');

-- Claims, marks and backlog inside this transaction ---------------------------------------

-- Start from an empty backlog: rows left undelivered by others are delivered here (and
-- rolled back at the end).
UPDATE ql3.contract_outbox SET delivered_at = now() WHERE delivered_at IS NULL;

SELECT results_eq(
    $$SELECT undelivered, oldest_age_seconds, max_seq FROM ql3.outbox_backlog()$$,
    $$SELECT 0::bigint, 0::double precision, (SELECT coalesce(max(seq), 0) FROM ql3.contract_outbox)$$,
    'outbox_backlog of an empty backlog: 0 rows, age 0, the highest seq'
);

CREATE TABLE tests.seqs (name text PRIMARY KEY, seq bigint NOT NULL);
CREATE TABLE tests.revs (name text PRIMARY KEY, revision_id uuid NOT NULL);

CREATE FUNCTION tests.rev(p_name text) RETURNS uuid
LANGUAGE sql STABLE AS $$
    SELECT r.revision_id FROM tests.revs AS r WHERE r.name = p_name;
$$;

CREATE FUNCTION tests.s(p_name text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT s.seq FROM tests.seqs AS s WHERE s.name = p_name;
$$;

CREATE FUNCTION tests.activate(p_name text, p_rev text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO tests.seqs (name, seq)
    SELECT p_name, (ql3.activate_revision('tap04-p', 'policy_routing', 'c1', tests.rev(p_rev), 'alice')).seq;
$$;

CREATE FUNCTION tests.row_of(p_name text)
RETURNS TABLE (delivered boolean, relay_attempts integer, last_error text)
LANGUAGE sql STABLE AS $$
    SELECT o.delivered_at IS NOT NULL, o.relay_attempts, o.last_error
    FROM ql3.contract_outbox AS o WHERE o.seq = tests.s(p_name);
$$;

INSERT INTO tests.revs (name, revision_id)
SELECT
    'r' || g.n AS name,
    (ql3.put_revision(
        'tap04-p', 'policy_routing', 'c1', jsonb_build_object('n', g.n), 'alice'
    )).revision_id AS revision_id
FROM generate_series(1, 3) AS g (n);

SELECT tests.activate('s1', 'r1');
SELECT tests.activate('s2', 'r2');
SELECT tests.activate('s3', 'r3');
SELECT tests.activate('s4', 'r1');
SELECT tests.activate('s5', 'r2');

SELECT results_eq(
    $$SELECT seq FROM ql3.claim_outbox(2)$$,
    $$SELECT tests.s(n) FROM unnest(ARRAY['s1', 's2']) AS n$$,
    'claim_outbox(2) returns the two oldest undelivered rows in seq order'
);

SELECT results_eq(
    $$SELECT seq FROM ql3.claim_outbox(10)$$,
    $$SELECT tests.s(n) FROM unnest(ARRAY['s1', 's2', 's3', 's4', 's5']) AS n$$,
    'claim_outbox(10) returns every undelivered row in seq order (the caller''s own locks do not hide rows)'
);

SELECT lives_ok($$SELECT * FROM ql3.claim_outbox(10000)$$, 'a limit of 10000 is accepted');
SELECT throws_ok($$SELECT * FROM ql3.claim_outbox(0)$$, 'Q3V01', NULL, 'a limit of 0 is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT * FROM ql3.claim_outbox(-1)$$, 'Q3V01', NULL, 'a negative limit is QL3_INVALID_ARGUMENT');
SELECT throws_ok($$SELECT * FROM ql3.claim_outbox(NULL)$$, 'Q3V01', NULL, 'a NULL limit is QL3_INVALID_ARGUMENT');
SELECT throws_ok(
    $$SELECT * FROM ql3.claim_outbox(10001)$$, 'Q3V01', NULL, 'a limit above 10000 is QL3_INVALID_ARGUMENT'
);

SELECT results_eq(
    $$SELECT undelivered, oldest_age_seconds, max_seq FROM ql3.outbox_backlog()$$,
    $$SELECT 5::bigint, 0::double precision, tests.s('s5')$$,
    'outbox_backlog counts the undelivered rows; rows of this transaction are 0 seconds old'
);

WITH old AS (
    INSERT INTO ql3.contract_outbox
        (event_type, project_id, contract_family, contract_id, new_revision_id, pointer_version, created_at)
    VALUES
        ('revision_activated', 'tap04-p', 'policy_routing', 'c1', tests.rev('r3'), 6, now() - interval '90 seconds')
    RETURNING seq
)
INSERT INTO tests.seqs (name, seq)
SELECT
    's6' AS name,
    old.seq
FROM old;

SELECT results_eq(
    $$SELECT undelivered, oldest_age_seconds, max_seq FROM ql3.outbox_backlog()$$,
    $$SELECT 6::bigint, 90::double precision, tests.s('s6')$$,
    'outbox_backlog reports the age of the oldest undelivered row by created_at, not by seq'
);

-- Failed deliveries.

SELECT is(
    ql3.mark_outbox_failed(ARRAY[tests.s('s1'), tests.s('s2')], 'redis down'),
    2,
    'mark_outbox_failed counts the rows it marked'
);

SELECT row_eq(
    $$SELECT * FROM tests.row_of('s1')$$,
    row(FALSE, 1, 'redis down'::text),
    'a failed row stays undelivered with one attempt and the error'
);

SELECT is(ql3.mark_outbox_failed(ARRAY[tests.s('s1')], NULL), 1, 'a second failure is counted');

SELECT row_eq(
    $$SELECT * FROM tests.row_of('s1')$$,
    row(FALSE, 2, 'unknown error'::text),
    'each failure adds an attempt; a NULL error is recorded as ''unknown error'''
);

SELECT is(ql3.mark_outbox_failed(ARRAY[tests.s('s2')], repeat('e', 3000)), 1, 'a failure with a long error is counted');

SELECT is(
    (SELECT char_length(last_error) FROM tests.row_of('s2')),
    2000,
    'last_error is cut to 2000 characters'
);

-- Deliveries.

SELECT is(
    ql3.mark_outbox_delivered(ARRAY[tests.s('s1'), tests.s('s2'), tests.s('s3')]),
    3,
    'mark_outbox_delivered counts the rows it marked'
);

SELECT row_eq(
    $$SELECT * FROM tests.row_of('s1')$$,
    row(TRUE, 3, NULL::text),
    'a delivered row has delivered_at, one more attempt, and no last_error'
);

CREATE TABLE tests.before_remark AS SELECT o.* FROM ql3.contract_outbox AS o WHERE o.seq = tests.s('s1');

SELECT is(
    ql3.mark_outbox_delivered(ARRAY[tests.s('s1'), tests.s('s3'), tests.s('s4')]),
    1,
    'marking delivered rows again counts only the undelivered one among them'
);

SELECT is(
    ql3.mark_outbox_failed(ARRAY[tests.s('s1'), tests.s('s5')], 'late failure'),
    1,
    'marking a delivered row failed counts only the undelivered one'
);

SELECT row_eq(
    $$SELECT * FROM ql3.contract_outbox WHERE seq = tests.s('s1')$$,
    (SELECT b FROM tests.before_remark AS b),
    'a delivered row is never re-marked: delivered_at, relay_attempts and last_error stay as they were'
);

SELECT is(ql3.mark_outbox_delivered(ARRAY[-1]::bigint []), 0, 'marking an unknown seq delivered changes nothing');
SELECT is(ql3.mark_outbox_delivered('{}'::bigint []), 0, 'marking no seqs delivered changes nothing');
SELECT is(ql3.mark_outbox_delivered(NULL), 0, 'marking NULL delivered changes nothing');
SELECT is(ql3.mark_outbox_failed(ARRAY[-1]::bigint [], 'x'), 0, 'marking an unknown seq failed changes nothing');

SELECT results_eq(
    $$SELECT seq FROM ql3.claim_outbox(10)$$,
    $$SELECT tests.s(n) FROM unnest(ARRAY['s5', 's6']) AS n$$,
    'claim_outbox skips delivered rows'
);

SELECT results_eq(
    $$SELECT undelivered, oldest_age_seconds, max_seq FROM ql3.outbox_backlog()$$,
    $$SELECT 2::bigint, 90::double precision, tests.s('s6')$$,
    'outbox_backlog after deliveries'
);

-- The guard trigger: only delivery columns change; only delivered rows are deleted.

SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET project_id = %L WHERE seq = %s', 'elsewhere', tests.s('s5')),
    'Q3S01', NULL, 'updating project_id is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET contract_family = %L WHERE seq = %s', 'channel_event', tests.s('s5')),
    'Q3S01', NULL, 'updating contract_family is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET contract_id = %L WHERE seq = %s', 'c2', tests.s('s5')),
    'Q3S01', NULL, 'updating contract_id is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET event_type = %L WHERE seq = %s', 'revision_revoked', tests.s('s5')),
    'Q3S01', NULL, 'updating event_type is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET event_id = gen_random_uuid() WHERE seq = %s', tests.s('s5')),
    'Q3S01', NULL, 'updating event_id is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET old_revision_id = %L WHERE seq = %s', tests.rev('r3'), tests.s('s5')),
    'Q3S01', NULL, 'updating old_revision_id is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET new_revision_id = %L WHERE seq = %s', tests.rev('r3'), tests.s('s5')),
    'Q3S01', NULL, 'updating new_revision_id is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET pointer_version = pointer_version + 1 WHERE seq = %s', tests.s('s5')),
    'Q3S01', NULL, 'updating pointer_version is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET created_at = now() - interval %L WHERE seq = %s', '1 hour', tests.s('s5')),
    'Q3S01', NULL, 'updating created_at is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET project_id = %L, delivered_at = now() WHERE seq = %s', 'x', tests.s('s5')),
    'Q3S01', NULL, 'an update mixing delivery and other columns is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET project_id = %L WHERE seq = %s', 'elsewhere', tests.s('s1')),
    'Q3S01', NULL, 'updating project_id of a delivered row is QL3_ILLEGAL_TRANSITION too'
);
SELECT throws_ok(
    format('UPDATE ql3.contract_outbox SET seq = DEFAULT WHERE seq = %s', tests.s('s5')),
    'Q3S01', NULL, 'updating seq is QL3_ILLEGAL_TRANSITION'
);

SELECT lives_ok(
    format('UPDATE ql3.contract_outbox SET relay_attempts = relay_attempts + 1, last_error = %L WHERE seq = %s',
           'manual', tests.s('s5')),
    'updating only the delivery columns is allowed'
);

SELECT throws_ok(
    format('DELETE FROM ql3.contract_outbox WHERE seq = %s', tests.s('s5')),
    'Q3S01', NULL, 'deleting an undelivered row is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$DELETE FROM ql3.contract_outbox WHERE project_id = 'tap04-p'$$,
    'Q3S01', NULL, 'a DELETE that includes any undelivered row is QL3_ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    'TRUNCATE ql3.contract_outbox',
    'Q3S01', NULL, 'TRUNCATE of the outbox is QL3_ILLEGAL_TRANSITION'
);

SELECT is(
    (SELECT count(*) FROM ql3.contract_outbox WHERE project_id = 'tap04-p'),
    6::bigint,
    'after the refused statements every outbox row is still there'
);

SELECT lives_ok(
    format('DELETE FROM ql3.contract_outbox WHERE seq = %s', tests.s('s1')),
    'deleting a delivered row is allowed (retention)'
);

SELECT is_empty(
    format('SELECT 1 FROM ql3.contract_outbox WHERE seq = %s', tests.s('s1')),
    'the delivered row is gone'
);

SELECT * FROM finish();
ROLLBACK;
