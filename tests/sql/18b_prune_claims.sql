-- Outbox retention beside a relay (D55), seen from other sessions through dblink: a prune
-- whose deletes are not yet committed neither blocks a relay's claim nor changes its seq
-- order, and a relay's open claim neither blocks a prune nor loses a row to it.
--
-- The dblink sessions commit real rows under a unique 'tap18b-<uuid>' project. This
-- file's delivered rows are set to 2000 and the cut-off is just after, so no other file's
-- row qualifies; every row it leaves behind is delivered, so later files see no backlog.
BEGIN;
SELECT plan(13);
SET LOCAL client_min_messages = warning;

\ir lib/outbox_helpers.sql
INSERT INTO tests.ctx (key, value) VALUES ('project', 'tap18b-' || gen_random_uuid());

-- Over dblink, in p_conn's open transaction: claim_outbox(p_limit), its seqs in order.
CREATE FUNCTION tests.remote_claim18b(p_conn text, p_limit integer) RETURNS bigint []
LANGUAGE sql AS $$
    SELECT coalesce(array_agg(t.seq ORDER BY t.seq), '{}')
    FROM dblink(p_conn, format('SELECT seq FROM ql3.claim_outbox(%s)', p_limit)) AS t (seq bigint);
$$;

-- Over dblink, in p_conn's session: prune_outbox with the cut-off below; rows removed.
CREATE FUNCTION tests.remote_prune18b(p_conn text) RETURNS integer
LANGUAGE sql AS $$
    SELECT t.removed
    FROM dblink(
        p_conn,
        format('SELECT ql3.prune_outbox(%L::interval, 100000)', now() - timestamptz '2000-01-02 00:00:00+00')
    ) AS t (removed integer);
$$;

-- Over dblink, in p_conn's session: mark_outbox_delivered of p_seqs; how many changed.
CREATE FUNCTION tests.remote_deliver18b(p_conn text, p_seqs bigint []) RETURNS integer
LANGUAGE sql AS $$
    SELECT t.n FROM dblink(p_conn, format('SELECT ql3.mark_outbox_delivered(%L::bigint[])', p_seqs)) AS t (n integer);
$$;

-- This file's rows still in the outbox, in seq order.
CREATE FUNCTION tests.present18b() RETURNS bigint []
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(o.seq ORDER BY o.seq), '{}') FROM ql3.contract_outbox AS o WHERE o.project_id = tests.p();
$$;

-- The p_limit oldest undelivered rows of the whole outbox: what a claim must return.
CREATE FUNCTION tests.oldest_undelivered18b(p_limit integer) RETURNS bigint []
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(u.seq ORDER BY u.seq), '{}')
    FROM (SELECT o.seq FROM ql3.contract_outbox AS o WHERE o.delivered_at IS NULL ORDER BY o.seq LIMIT p_limit) AS u;
$$;

CREATE TABLE tests.seqs18b (name text PRIMARY KEY, seq bigint NOT NULL);

CREATE FUNCTION tests.s18b(p_names text []) RETURNS bigint []
LANGUAGE sql STABLE AS $$
    SELECT array_agg(s.seq ORDER BY s.seq) FROM tests.seqs18b AS s WHERE s.name = ANY(p_names);
$$;


SELECT dblink_connect('tap18b_w', tests.dsn());
SELECT dblink_connect('tap18b_relay', tests.dsn());
SELECT dblink_connect('tap18b_prune', tests.dsn());
-- No session may wait on another: a wait would end in a statement timeout.
SELECT dblink_exec('tap18b_relay', 'SET statement_timeout = ''5s''');
SELECT dblink_exec('tap18b_prune', 'SET statement_timeout = ''5s''');
SELECT dblink_exec('tap18b_w', 'SET statement_timeout = ''5s''');

-- Anything an earlier file left undelivered is delivered first: the claims below see only
-- this file's rows.
SELECT t.n
FROM dblink(
    'tap18b_w',
    'SELECT ql3.mark_outbox_delivered(array_agg(seq)) FROM ql3.contract_outbox WHERE delivered_at IS NULL'
) AS t (n integer);

-- Contract a: a1..a4 (pointer at a4); contract b: b1..b3 (pointer at b3).
INSERT INTO tests.seqs18b (name, seq)
SELECT
    'a' || g.n AS name,
    tests.remote_activate('tap18b_w', 'a', g.n) AS seq
FROM generate_series(1, 4) AS g (n);
INSERT INTO tests.seqs18b (name, seq)
SELECT
    'b' || g.n AS name,
    tests.remote_activate('tap18b_w', 'b', g.n) AS seq
FROM generate_series(1, 3) AS g (n);

-- a1..a3 and b1 delivered in 2000 (prunable); a4, b2, b3 wait for the relay.
SELECT tests.remote_deliver18b('tap18b_w', tests.s18b('{a1,a2,a3,b1}'));
SELECT dblink_exec('tap18b_w', format(
    'UPDATE ql3.contract_outbox SET delivered_at = timestamptz ''2000-01-01 00:00:00+00'' WHERE seq = ANY(%L::bigint[])',
    tests.s18b('{a1,a2,a3,b1}')
));

SELECT is(
    tests.oldest_undelivered18b(10), tests.s18b('{a4,b2,b3}'),
    'the backlog is a4, b2, b3 in seq order'
);

-- 1. A prune holds its deletes uncommitted; the relay claims meanwhile ------------------------

SELECT dblink_exec('tap18b_prune', 'BEGIN');
SELECT is(
    tests.remote_prune18b('tap18b_prune'), 4,
    'the prune removes a1..a3 and b1: delivered long ago, each below its pointer'
);
SELECT is(
    tests.remote_prune18b('tap18b_w'), 0,
    'a second prune meanwhile skips the rows the first one holds instead of waiting on them'
);
SELECT dblink_exec('tap18b_relay', 'BEGIN');
SELECT is(
    tests.remote_claim18b('tap18b_relay', 2), tests.s18b('{a4,b2}'),
    'meanwhile the relay claims the two oldest undelivered rows in seq order, without waiting'
);
SELECT is(tests.remote_deliver18b('tap18b_relay', tests.s18b('{a4,b2}')), 2, 'and marks them delivered');
SELECT dblink_exec('tap18b_relay', 'COMMIT');
SELECT dblink_exec('tap18b_prune', 'COMMIT');
SELECT is(
    tests.present18b(), tests.s18b('{a4,b2,b3}'),
    'after both commit: the pruned rows are gone, the delivered newest and the undelivered rows stay'
);

-- 2. The relay holds a claim uncommitted; a prune runs meanwhile ------------------------------

-- b2 (delivered, below b3) becomes prunable; b3 waits for the relay.
SELECT dblink_exec('tap18b_w', format(
    'UPDATE ql3.contract_outbox SET delivered_at = timestamptz ''2000-01-01 00:00:00+00'' WHERE seq = ANY(%L::bigint[])',
    tests.s18b('{a4,b2}')
));
SELECT dblink_exec('tap18b_relay', 'BEGIN');
SELECT is(
    tests.remote_claim18b('tap18b_relay', 10), tests.s18b('{b3}'),
    'the relay claims b3, the one undelivered row'
);
SELECT is(
    tests.remote_prune18b('tap18b_prune'), 1,
    'meanwhile a prune removes b2 alone, without waiting on the claim'
);
SELECT is(
    tests.present18b(), tests.s18b('{a4,b3}'),
    'the claimed row and each pointer''s newest row are still there'
);
SELECT is(
    tests.remote_claim18b('tap18b_prune', 10), '{}'::bigint [],
    'a second claimer skips the row the relay holds (nothing else is undelivered)'
);
SELECT is(tests.remote_deliver18b('tap18b_relay', tests.s18b('{b3}')), 1, 'the relay marks its claim delivered');
SELECT dblink_exec('tap18b_relay', 'COMMIT');
SELECT is(tests.oldest_undelivered18b(10), '{}'::bigint [], 'nothing is left undelivered');
SELECT is(
    tests.remote_prune18b('tap18b_prune'), 0,
    'a further prune removes nothing: a4 and b3 are their pointers'' newest rows'
);

SELECT dblink_disconnect('tap18b_w');
SELECT dblink_disconnect('tap18b_relay');
SELECT dblink_disconnect('tap18b_prune');

SELECT * FROM finish();
ROLLBACK;
